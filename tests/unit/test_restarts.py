"""alpha-run's restarts, in one process: the context a restarted worker reads, what a restart resumes,
which failure caused a restart, and the agent torch's launcher is given for the launch."""
import argparse
import dataclasses
import json
import signal
import time
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

import alpha_ckpt
from alpha_ckpt.runtime import launch_env
from alpha_ckpt.launch import launcher
from alpha_ckpt.job.owner import Resume, attempt_resume
from alpha_ckpt.job.usage import JOB_OPTIONS

ROOT = "ab" * 32
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "forecast.toml"


@pytest.fixture
def clean_restart_env(monkeypatch):
    for name in (launch_env.RESTART, launch_env.RESTART_COUNT, launch_env.OPTIONS):
        monkeypatch.setenv(name, "")  # recorded, so that what a test exports is taken back after it
        monkeypatch.delenv(name)
    return monkeypatch


def restarted(monkeypatch, attempt=1, *, resume="latest", failed_rank=1, failed_exit=-9, detected_at=None):
    detected_at = time.time() if detected_at is None else detected_at
    launch_env.export_restart(attempt=attempt, detected_at=detected_at, failed_rank=failed_rank,
                              failed_exit=failed_exit, resume=resume)
    monkeypatch.setenv(launch_env.RESTART_COUNT, str(attempt))
    return detected_at


def test_the_first_attempt_has_no_restart_context(clean_restart_env):
    clean_restart_env.setenv(launch_env.RESTART_COUNT, "0")
    assert launch_env.restart_context() is None and launch_env.restart_attempt() == 0


def test_a_restarted_worker_reads_what_the_launcher_exported_for_its_attempt(clean_restart_env):
    detected = restarted(clean_restart_env, 2, resume=ROOT, failed_rank=3, failed_exit=-9)
    context = launch_env.restart_context()
    assert (context.attempt, context.detected_at, context.failed_rank, context.failed_exit, context.resume) == \
        (2, detected, 3, -9, ROOT)
    # This process started before the test ran, and its start time is read from the kernel, not now.
    assert context.process_started_at <= time.time()
    assert context.restart_s == pytest.approx(context.process_started_at - detected)
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.attempt = 3


def test_the_context_is_plain_json_in_the_environment(clean_restart_env):
    restarted(clean_restart_env, 1)
    record = json.loads(launch_env.os.environ[launch_env.RESTART])
    assert set(record) == {"attempt", "detected_at", "failed_rank", "failed_exit", "resume", "started_at"}
    assert record["started_at"] is None  # a new process: its start is read from the kernel


def test_a_rank_that_rejoins_in_its_process_counts_its_restart_from_when_it_rejoined(clean_restart_env):
    launch_env.export_restart(attempt=0, detected_at=100.0, failed_rank=1, failed_exit=-9, resume="latest",
                              started_at=100.25)
    context = launch_env.restart_context()
    assert context.process_started_at == 100.25 and context.restart_s == pytest.approx(0.25)


def test_a_context_written_for_another_attempt_is_none(clean_restart_env):
    restarted(clean_restart_env, 1)
    clean_restart_env.setenv(launch_env.RESTART_COUNT, "2")
    assert launch_env.restart_context() is None


@pytest.mark.parametrize("raw", ["", "{", "[]", '{"attempt": 1}', '{"attempt": "1", "detected_at": 1.0}',
                                 '{"attempt": 1, "detected_at": NaN}', '{"attempt": 1, "detected_at": true}',
                                 '{"attempt": 1, "detected_at": 1.0, "failed_rank": "1"}',
                                 '{"attempt": 1, "detected_at": 1.0, "resume": 5}'])
def test_a_context_that_cannot_be_read_is_none(clean_restart_env, raw):
    clean_restart_env.setenv(launch_env.RESTART, raw)
    clean_restart_env.setenv(launch_env.RESTART_COUNT, "1")
    assert launch_env.restart_context() is None


def test_an_unknown_failed_rank_and_exit_are_none(clean_restart_env):
    restarted(clean_restart_env, 1, failed_rank=None, failed_exit=None, resume=None)
    context = launch_env.restart_context()
    assert context.failed_rank is None and context.failed_exit is None and context.resume is None


def test_the_launchers_environment_starts_without_a_restart_context_and_is_put_back(clean_restart_env):
    clean_restart_env.setenv(launch_env.RESTART, "inherited")
    with launch_env.exported(1):
        assert launch_env.RESTART not in launch_env.os.environ
        launch_env.export_restart(attempt=1, detected_at=1.0, failed_rank=0, failed_exit=1, resume="latest")
    assert launch_env.os.environ[launch_env.RESTART] == "inherited"


def test_a_restarted_script_resumes_what_the_launcher_chose_not_its_first_flag(clean_restart_env):
    clean_restart_env.setenv(launch_env.OPTIONS, json.dumps({"store": "/s", "run": "r", "resume": ROOT}))
    assert launch_env.launcher_settings()["resume"] == ROOT
    restarted(clean_restart_env, 1, resume="latest")
    assert launch_env.launcher_settings()["resume"] == "latest"


# ------------------------------------------------------------------ the job's choice per attempt

def job_args(**flags):
    return argparse.Namespace(**{"resume": None, "resume_from": None, "branch_from": None, **flags})


@pytest.mark.parametrize("flags, first", [
    ({}, None),
    ({"resume": "latest"}, Resume(latest=True)),
    ({"resume_from": ROOT}, Resume(root=ROOT)),
    ({"branch_from": ROOT}, Resume(root=ROOT, branch=True)),
])
def test_the_jobs_first_attempt_keeps_its_flags(clean_restart_env, flags, first):
    assert attempt_resume(job_args(**flags)) == first


@pytest.mark.parametrize("flags", [{}, {"resume": "latest"}, {"resume_from": ROOT}])
def test_a_restarted_job_resumes_the_newest_generation_when_the_launcher_says_so(clean_restart_env, flags):
    restarted(clean_restart_env, 1, resume="latest")
    assert attempt_resume(job_args(**flags)) == Resume(latest=True)


def test_a_restarted_job_resumes_the_root_the_launcher_names(clean_restart_env):
    restarted(clean_restart_env, 1, resume=ROOT)
    assert attempt_resume(job_args(resume_from=ROOT)) == Resume(root=ROOT)


def test_a_restarted_branch_whose_run_has_no_generation_branches_again(clean_restart_env):
    restarted(clean_restart_env, 1, resume=None)
    assert attempt_resume(job_args(branch_from=ROOT)) == Resume(root=ROOT, branch=True)


@pytest.mark.parametrize("flags, expected", [
    ({}, Resume(latest=True)),
    ({"resume": "latest"}, Resume(latest=True)),
    ({"resume_from": ROOT}, Resume(root=ROOT)),  # plain torchrun chooses nothing: the named generation is kept
])
def test_a_job_restarted_by_plain_torchrun_resumes_the_newest_generation_unless_one_is_named(clean_restart_env,
                                                                                             flags, expected):
    clean_restart_env.setenv(launch_env.RESTART_COUNT, "1")
    assert attempt_resume(job_args(**flags)) == expected


# ------------------------------------------------------------------ what a restart resumes

@given(root_epoch=st.integers(0, 5), newest_epoch=st.integers(0, 6))
def test_a_restart_after_resume_from_goes_back_to_root_only_while_nothing_continued_it(root_epoch, newest_epoch):
    chosen = launcher.resume_after_restart(ROOT, root_epoch=root_epoch, newest_epoch=newest_epoch)
    assert chosen == ("latest" if newest_epoch > root_epoch else ROOT)


def test_a_restart_without_resume_from_resumes_the_newest_generation():
    assert launcher.resume_after_restart(None, root_epoch=None, newest_epoch=None) == "latest"


def test_a_restart_after_resume_from_a_root_not_in_the_store_keeps_it_for_its_restore_to_refuse():
    assert launcher.resume_after_restart(ROOT, root_epoch=None, newest_epoch=None) == ROOT


def _save(store, update, epoch, run="nightly", step="fit"):
    import torch
    return alpha_ckpt.save({"w": torch.full((4,), float(update))}, store=store, run=run, step=step, update=update,
                           cursor=update, epoch=epoch)


def test_a_restart_reads_the_store_for_whether_roots_continuation_published(tmp_path):
    store = str(tmp_path / "s")
    old = _save(store, 1, 0)
    root = _save(store, 2, 0)
    assert launcher.restart_resume(store, resume_from=old) == old
    _save(store, 3, 1)  # the first attempt's continuation (epoch 1) published
    assert launcher.restart_resume(store, resume_from=root) == "latest"
    assert launcher.restart_resume(store, resume_from=None) == "latest"


def test_a_restarted_branch_resumes_its_new_run_once_it_has_a_generation(clean_restart_env, tmp_path):
    store = str(tmp_path / "s")
    root = _save(store, 2, 0)
    args = job_args(branch_from=root, store=store, set=["run=what-if"], config=str(CONFIG), updates=3,
                    **{name: None for name in JOB_OPTIONS}, timeout=60.0)
    restarted(clean_restart_env, 1, resume="latest")
    assert attempt_resume(args) == Resume(root=root, branch=True)  # the new run has no generation: again
    _save(store, 3, 0, run="what-if", step="fit")
    assert attempt_resume(args) == Resume(latest=True)


# ------------------------------------------------------------------ which failure caused the restart

@dataclasses.dataclass
class ProcessFailure:  # torch's fields that first_failure reads
    exitcode: int
    timestamp: int


def test_a_rank_killed_by_a_signal_is_the_cause_not_the_peer_that_exited_after_it():
    failures = {0: ProcessFailure(75, 100), 1: ProcessFailure(-signal.SIGKILL, 100)}
    assert launcher.first_failure(failures, 5.0) == launcher.Failure(5.0, 1, -signal.SIGKILL)


def test_the_agents_own_sigterm_is_never_the_cause():
    failures = {0: ProcessFailure(-signal.SIGTERM, 100), 1: ProcessFailure(2, 100)}
    assert launcher.first_failure(failures, 5.0).rank == 1


def test_an_earlier_failure_is_the_cause_whatever_its_kind():
    failures = {0: ProcessFailure(1, 99), 1: ProcessFailure(-signal.SIGKILL, 100)}
    assert launcher.first_failure(failures, 5.0).rank == 0


def test_no_failure_known_leaves_rank_and_exit_unknown():
    assert launcher.first_failure({}, 5.0) == launcher.Failure(5.0)


def test_torchs_launcher_is_given_the_restarting_agent_for_the_launch_only():
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api as launcher_api
    with launcher.restarting_agent(lambda attempt, failure: None):
        assert issubclass(launcher_api.LocalElasticAgent, LocalElasticAgent)
        assert launcher_api.LocalElasticAgent is not LocalElasticAgent
    assert launcher_api.LocalElasticAgent is LocalElasticAgent
