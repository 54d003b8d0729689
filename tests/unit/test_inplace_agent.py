"""The --in-place agent's decision when a rank exits (alpha_ckpt.launch.inplace.on_exit), and its worker environment."""
from hypothesis import given, settings
from hypothesis import strategies as st

from alpha_ckpt.launch.inplace import CONTROL, TIMEOUT, Action, on_exit, worker_environment

EXITS = st.lists(st.tuples(st.integers(0, 3),  # rank
                           st.sampled_from([0, 1, 2, 3, 75, -9, -15]),  # exit status
                           st.booleans()),  # whether it had joined the current round
                 max_size=30)


@settings(max_examples=300, deadline=None)
@given(EXITS, st.integers(1, 4))
def test_restarts_never_exceed_the_budget_and_only_a_failure_of_the_current_round_counts(exits, max_restarts):
    started_in = {rank: 0 for rank in range(4)}
    round_, restarts = 0, 0
    for rank, code, joined in exits:
        action = on_exit(code, started_in=started_in[rank], round_=round_, joined=joined, restarts=restarts,
                         max_restarts=max_restarts)
        if code == 0:
            assert action is Action.DONE
        elif code in (2, 3):
            assert action is Action.STOP  # a usage error or a refusal repeats on a restart
            break
        elif started_in[rank] < round_ and not joined:
            assert action is Action.REPLACE  # fell with the failure that began this round
            started_in[rank] = round_
        elif restarts == max_restarts:
            assert action is Action.EXHAUSTED
            break
        else:
            assert action is Action.NEW_ROUND
            restarts, round_ = restarts + 1, round_ + 1
            started_in[rank] = round_
        assert restarts <= max_restarts


def test_a_replacement_that_fails_before_joining_its_own_round_counts_as_a_new_failure():
    assert on_exit(1, started_in=2, round_=2, joined=False, restarts=1, max_restarts=3) is Action.NEW_ROUND
    assert on_exit(-9, started_in=2, round_=2, joined=False, restarts=3, max_restarts=3) is Action.EXHAUSTED


def test_worker_environment_is_torchruns_for_one_node_and_names_the_control_store():
    env = worker_environment({"PATH": "/bin"}, rank=2, world=4, round_=1, port=1234, control_port=999,
                             run_id="abc", max_restarts=3, timeout=30.0)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                                "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
                                "TORCHELASTIC_USE_AGENT_STORE")} == {
        "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
        "ROLE_RANK": "2", "MASTER_PORT": "1234", "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_RUN_ID": "abc",
        "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert env[CONTROL].endswith(":999") and float(env[TIMEOUT]) == 30.0
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "1"
