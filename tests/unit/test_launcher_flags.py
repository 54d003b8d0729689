"""alpha-run takes torchrun's launcher flags and PET_ variables, with torchrun's precedence, and hands
torch's launcher the launch torchrun itself would make of the same command line and environment."""
import pytest

from alpha_ckpt.launch import launcher
from torch.distributed.run import get_args_parser, parse_min_max_nnodes

# What Kubeflow Trainer v2's torch runtime sets on every node of a two-node job (node 1 here).
TRAINER_V2 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
              "PET_MASTER_ADDR": "10.0.0.7", "PET_MASTER_PORT": "29501"}
# What PyTorchJob's elastic policy sets: c10d rendezvous, a node range, restarts.
PYTORCHJOB_ELASTIC = {"PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "2", "PET_RDZV_BACKEND": "c10d",
                      "PET_RDZV_ENDPOINT": "job-worker-0:29400", "PET_RDZV_ID": "job", "PET_MAX_RESTARTS": "3",
                      "PET_RDZV_CONF": "join_timeout=600,last_call_timeout=5", "PET_LOCAL_ADDR": "10.0.0.8",
                      "PET_LOCAL_RANKS_FILTER": "0"}
LAUNCH_FIELDS = ("nproc_per_node", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                 "rdzv_id", "rdzv_conf", "local_addr", "local_ranks_filter", "max_restarts", "standalone")


def _set(monkeypatch, variables):
    for name in [n for n in __import__("os").environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def _handed_to_torch(argv):
    return launcher.torchrun_args(launcher.script_argv(launcher.parse(argv)))


def _torchrun(argv):
    return get_args_parser().parse_args([*argv, "train.py"])


@pytest.mark.parametrize("variables", [TRAINER_V2, PYTORCHJOB_ELASTIC], ids=["trainer-v2", "pytorchjob-elastic"])
def test_a_launch_described_only_by_pet_variables_reaches_torch_as_torchrun_would_launch_it(monkeypatch, variables):
    _set(monkeypatch, variables)
    ours, theirs = _handed_to_torch(["--store", "s", "train.py"]), _torchrun([])
    for field in LAUNCH_FIELDS:
        assert str(getattr(ours, field)) == str(getattr(theirs, field)), field
    assert parse_min_max_nnodes(ours.nnodes) == parse_min_max_nnodes(theirs.nnodes)


def test_a_flag_on_the_command_line_wins_over_its_pet_variable(monkeypatch):
    _set(monkeypatch, {**TRAINER_V2, "PET_RDZV_CONF": "is_host=1", "PET_LOCAL_RANKS_FILTER": "1"})
    flags = ["--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "3", "--master-port", "29777", "--rdzv-conf", "is_host=0",
             "--local-ranks-filter", "0,2"]
    ours, theirs = _handed_to_torch([*flags, "--store", "s", "train.py"]), _torchrun(flags)
    assert (ours.nnodes, ours.node_rank, ours.nproc_per_node, ours.master_port, ours.rdzv_conf,
            ours.local_ranks_filter) == ("1", 0, "3", 29777, "is_host=0", "0,2")
    for field in LAUNCH_FIELDS:
        assert str(getattr(ours, field)) == str(getattr(theirs, field)), field


def test_without_flags_or_variables_the_launch_is_one_node_of_one_rank(monkeypatch):
    _set(monkeypatch, {})
    args = launcher.parse(["--store", "s", "train.py"])
    assert (args.nnodes, args.nproc, args.node_rank, args.standalone) == ("1", 1, 0, False)
    assert launcher.one_node(args)


def test_torchruns_own_spelling_of_one_node_is_one_node(monkeypatch):
    _set(monkeypatch, {"PET_NNODES": "1:1", "PET_MAX_RESTARTS": "2"})
    args = launcher.parse(["--store", "s", "train.py"])
    # One node with restarts: torch's c10d rendezvous on a free port, as with --nnodes 1.
    assert launcher.one_node(args) and launcher.restarts_on_one_node(args)
    assert not launcher.static_rendezvous(args)


@pytest.mark.parametrize("value, standalone", [("1", True), ("0", False)])
def test_pet_standalone_is_read_as_torchrun_reads_it(monkeypatch, value, standalone):
    _set(monkeypatch, {"PET_STANDALONE": value})
    assert launcher.parse(["--store", "s", "train.py"]).standalone is standalone
    assert ("--standalone" in launcher.torchrun_argv(launcher.parse(["--store", "s", "train.py"]))) is standalone


def test_nproc_auto_is_this_hosts_count_as_torchrun_counts_it(monkeypatch, tmp_path):
    from torch.distributed.run import determine_local_world_size
    _set(monkeypatch, {"PET_NPROC_PER_NODE": "auto"})
    args = launcher.parse(["--store", str(tmp_path / "s"), "train.py"])
    launcher.check_launch_args(args)
    assert args.nproc == determine_local_world_size("auto")
