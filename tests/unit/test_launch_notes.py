"""What a rank tells alpha-run through the launch's directory, in one process: whether it reached a checkpoint
call in its attempt (a failure before one is the script's own error: exit 1, no restart), and the verdict it
ended with (printed once by the launcher, naming the ranks)."""
import pytest
import torch

import alpha_ckpt
from alpha_ckpt.runtime import launch_env
from alpha_ckpt.launch.inplace import Action, on_exit
from alpha_ckpt.launch.script_runner import peer_failed


@pytest.fixture
def launch(tmp_path, monkeypatch):
    """This process as rank 1 of attempt 0 of an alpha-run launch whose directory is ``tmp_path``."""
    monkeypatch.setenv(launch_env.LAUNCH_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(launch_env.RESTART_COUNT, "0")
    monkeypatch.setattr(launch_env, "_noted", set())
    return tmp_path


def test_an_error_exit_before_any_checkpoint_call_is_the_scripts_own(launch):
    assert launch_env.failed_before_checkpoint(str(launch), 0, 1, 1)
    launch_env.note_checkpoint_call()
    assert not launch_env.failed_before_checkpoint(str(launch), 0, 1, 1)  # after one: retryable
    assert launch_env.failed_before_checkpoint(str(launch), 0, 0, 1)  # another rank's note is its own


def test_a_checkpoint_call_counts_in_its_own_attempt_only(launch, monkeypatch):
    launch_env.note_checkpoint_call()
    monkeypatch.setenv(launch_env.RESTART_COUNT, "1")
    assert launch_env.failed_before_checkpoint(str(launch), 1, 1, 1)
    launch_env.note_checkpoint_call()  # a rank recovering in place: its new attempt's first call
    assert not launch_env.failed_before_checkpoint(str(launch), 1, 1, 1)


@pytest.mark.parametrize("exitcode", [-9, -6, 2, 3, 75, 0, None])
def test_a_signal_a_verdict_and_a_retryable_exit_are_never_the_scripts_own_error(launch, exitcode):
    assert not launch_env.failed_before_checkpoint(str(launch), 0, 1, exitcode)


def test_without_a_launch_directory_no_failure_is_called_the_scripts_own(launch):
    assert not launch_env.failed_before_checkpoint("", 0, 1, 1)


def test_a_peer_failure_is_noted_as_retryable(launch):
    launch_env.note_peer_failure()
    assert not launch_env.failed_before_checkpoint(str(launch), 0, 1, 1)


def test_the_cause_of_an_attempts_failure_is_its_earliest_rank_that_did_not_fail_with_a_peer(launch, monkeypatch):
    directory = str(launch)
    assert launch_env.own_error(directory, 0, [(0, 1), (1, 1)]) == (0, 1)  # nothing noted: the earliest
    assert launch_env.own_error(directory, 0, [(0, -15), (1, 1)]) == (1, 1)  # SIGTERM: the agent stopping rank 0
    launch_env.note_peer_failure()  # rank 1 failed because a peer did
    # Rank 1 failed with a peer at the same moment, listed first: rank 0's error before any checkpoint is the cause.
    assert launch_env.own_error(directory, 0, [(1, 1), (0, 1)]) == (0, 1)
    monkeypatch.setenv("RANK", "0")
    launch_env.note_checkpoint_call()
    assert launch_env.own_error(directory, 0, [(1, 1), (0, 1)]) is None  # rank 0 had checkpointed: retryable
    assert launch_env.own_error(directory, 1, [(0, 1), (1, -9)]) is None  # a rank killed: retryable
    assert launch_env.own_error(directory, 1, [(0, 75)]) is None  # the script asked to be retried


def test_the_one_process_apis_save_and_restore_note_their_checkpoint_call(launch):
    store = launch / "s"
    root = alpha_ckpt.save({"w": torch.ones(2)}, store=store, run="r", step="s", update=1, cursor=0, epoch=0)
    assert launch_env.noted(str(launch), "reached", 0, 1)
    launch_env._noted.clear()
    (launch / "reached" / "0.1").unlink()
    alpha_ckpt.restore({"w": torch.zeros(2)}, store=store, root=root)
    assert launch_env.noted(str(launch), "reached", 0, 1)


def test_outside_alpha_run_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(launch_env.LAUNCH_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    launch_env.note_checkpoint_call()
    assert not launch_env.record_verdict("refused", "[format] x")
    assert list(tmp_path.iterdir()) == []


def test_a_verdict_met_by_several_ranks_is_told_once_with_the_ranks(launch, monkeypatch):
    for rank in (3, 0, 1, 2):
        monkeypatch.setenv("RANK", str(rank))
        assert launch_env.record_verdict("refused", "[foreign-learner] another model")
    monkeypatch.setenv("RANK", "5")
    launch_env.record_verdict("usage", "keep must be at least 2")
    assert launch_env.recorded_verdicts(str(launch)) == [
        ("refused", "[foreign-learner] another model", [0, 1, 2, 3]), ("usage", "keep must be at least 2", [5])]


@pytest.mark.parametrize("ranks,text", [([3], "rank 3"), ([0, 1, 2, 3], "ranks 0-3"), ([0, 2, 5, 6, 7], "ranks 0, 2, 5-7")])
def test_ranks_are_named_as_a_person_reads_them(ranks, text):
    assert launch_env.ranks_text(ranks) == text


def test_in_place_a_rank_error_before_any_checkpoint_call_stops_every_rank_without_a_restart():
    assert on_exit(1, started_in=0, round_=0, joined=True, restarts=0, max_restarts=3,
                   before_checkpoint=True) is Action.OWN_ERROR
    # A rank of an older round that fell with the failure that began this one is replaced, as before.
    assert on_exit(1, started_in=0, round_=1, joined=False, restarts=1, max_restarts=3,
                   before_checkpoint=True) is Action.REPLACE
    assert on_exit(1, started_in=0, round_=0, joined=True, restarts=0, max_restarts=3) is Action.NEW_ROUND


def test_an_error_that_says_a_peer_failed_is_told_from_the_scripts_own():
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
                        "by peer [127.0.0.1]:58546")
    assert peer_failed(gloo)
    assert peer_failed(torch.distributed.DistNetworkError("rendezvous store unreachable"))
    assert peer_failed(ConnectionResetError())
    wrapped = ValueError("loading the batch failed")
    wrapped.__cause__ = gloo
    assert peer_failed(wrapped)
    assert not peer_failed(ValueError("hidden size must be positive"))
    assert not peer_failed(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
