"""Several nodes simulated on one machine: one alpha-run process per node, each in its own working
directory, over the loopback interface and one shared store, launched as the recipes of
docs/MANY_NODES.md launch them (SLURM's srun line run by bash with SLURM's variables; Kubeflow's
bare launcher with the PET_ variables its torch runtime sets)."""
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
RECIPES = (ROOT / "docs" / "MANY_NODES.md").read_text()
PROBE = ROOT / "tests" / "worker_environment.py"
CONFIG = str(ROOT / "configs" / "forecast.toml")
SMALL = ["--set", "batch=24", "--set", "hidden=16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _block(lang: str, containing: str) -> str:
    (block,) = [b for b in re.findall(rf"```{lang}\n(.*?)```", RECIPES, re.S) if containing in b]
    return block


def _replaced(text: str, old: str, new: str) -> str:
    assert old in text, f"the recipe no longer has {old!r}"
    return text.replace(old, new)


def _nodes(argvs: list[list[str]], envs: list[dict], cwd: Path, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    nodes = []
    for k, (argv, env) in enumerate(zip(argvs, envs)):
        (cwd / f"node{k}").mkdir(exist_ok=True)
        nodes.append(launch.alpha_run_start(*argv, cwd=cwd / f"node{k}", env=launch.child_env(env)))
    try:
        return [node.result(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()


def _ranks_seen(directory: Path) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in directory.glob("rank-*.json")}


def _slurm_argv(node_id: int, port: int, store: Path, out: Path) -> tuple[list[str], dict]:
    """The recipe's alpha-run line, expanded by bash with the variables srun gives node ``node_id`` of two."""
    script = _block("bash", "srun")
    line = re.search(r"bash -c '(alpha-run .*?)'", script, re.S).group(1)
    line = _replaced(line, "--nproc 8", "--nproc 2")
    line = _replaced(line, ":29500", f":{port}")
    line = _replaced(line, "s3://ckpt/llm", str(store))
    line = _replaced(line, "train.py --config llm.toml", f"{PROBE} {out}")
    # Two flags the recipe leaves out, given by their PET_ variables.
    env = dict(os.environ, SLURM_NNODES="2", SLURM_NODEID=str(node_id), SLURM_JOB_ID="4242", HEAD_NODE="127.0.0.1",
               PET_LOCAL_RANKS_FILTER="0", PET_LOCAL_ADDR=f"127.0.0.{2 + node_id}")
    printed = subprocess.run(["bash", "-c", line.replace("alpha-run", "printf '%s\\0'", 1)], env=env,
                             capture_output=True, check=True, timeout=30).stdout.decode()
    return printed.split("\0")[:-1], env


@pytest.mark.timeout(300)
def test_the_slurm_recipe_runs_two_nodes_of_two_ranks_as_one_job(tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    port = _free_port()
    launches = [_slurm_argv(k, port, tmp_path / "store", out) for k in (0, 1)]
    done = _nodes([argv for argv, _ in launches], [env for _, env in launches], tmp_path)
    assert [p.returncode for p in done] == [0, 0], [p.stderr[-1500:] for p in done]
    seen = _ranks_seen(out)
    assert sorted(seen) == [0, 1, 2, 3] and all(s["sum"] == 4 for s in seen.values())
    assert {s["TORCHELASTIC_RUN_ID"] for s in seen.values()} == {"4242"}
    assert all((s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["GROUP_WORLD_SIZE"]) == ("4", "2", "2") for s in seen.values())
    assert all(s["ROLE_RANK"] == str(rank) and int(s["GROUP_RANK"]) == rank // 2 for rank, s in seen.items())
    assert all(s["TORCHELASTIC_MAX_RESTARTS"] == "3" for s in seen.values())
    # PET_LOCAL_ADDR: the ranks reach their group's store at the address of the node that holds group rank 0,
    # which c10d assigns by join order.
    assert len({s["MASTER_ADDR"] for s in seen.values()}) == 1
    assert seen[0]["MASTER_ADDR"] in ("127.0.0.2", "127.0.0.3")
    # PET_LOCAL_RANKS_FILTER=0: each node's console shows its local rank 0 only.
    for p in done:
        assert re.findall(r"local rank (\d) of group \d joined", p.stdout) == ["0"], p.stdout


def _trainer_v2_environment(node_rank: int, port: int) -> dict:
    """What Kubeflow Trainer v2's torch runtime sets on node ``node_rank`` of two, two ranks a node."""
    return dict(os.environ, PET_NNODES="2", PET_NPROC_PER_NODE="2", PET_NODE_RANK=str(node_rank),
                PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))


def _trainer_v2_argv(store: str, program: list[str]) -> list[str]:
    command = json.loads(re.search(r"command: (\[.*?\])", _block("yaml", "TrainJob")).group(1))
    assert command[0] == "alpha-run"
    argv = _replaced(" ".join(command[1:]), "s3://ckpt/llm", store)
    argv = _replaced(argv, "train.py --config llm.toml", "PROGRAM")
    words = argv.split()
    at = words.index("PROGRAM")
    return [*words[:at], *program, *words[at + 1:]]


@pytest.mark.timeout(300)
def test_a_launch_described_only_by_kubeflows_pet_variables_runs_on_two_nodes(tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    port = _free_port()
    argv = _trainer_v2_argv(str(tmp_path / "store"), [str(PROBE), str(out)])
    done = _nodes([argv, argv], [_trainer_v2_environment(k, port) for k in (0, 1)], tmp_path)
    assert [p.returncode for p in done] == [0, 0], [p.stderr[-1500:] for p in done]
    seen = _ranks_seen(out)
    assert sorted(seen) == [0, 1, 2, 3] and all(s["sum"] == 4 for s in seen.values())
    # The static rendezvous: node K's local rank L is rank 2K + L.
    assert all((int(s["GROUP_RANK"]), int(s["LOCAL_RANK"])) == divmod(rank, 2) for rank, s in seen.items())
    assert all((s["WORLD_SIZE"], s["LOCAL_WORLD_SIZE"], s["MASTER_PORT"]) == ("4", "2", str(port))
               for s in seen.values())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_elastic_pytorchjob_launch_of_one_to_two_nodes_forms_one_job_of_both(tmp_path):
    # PyTorchJob's elastic policy: c10d, a node range, restarts, all by PET_ variables.
    out = tmp_path / "ranks"
    out.mkdir()
    env = dict(os.environ, PET_NNODES="1:2", PET_NPROC_PER_NODE="2", PET_RDZV_BACKEND="c10d",
               PET_RDZV_ENDPOINT=f"127.0.0.1:{_free_port()}", PET_RDZV_ID="elastic", PET_MAX_RESTARTS="1",
               PET_RDZV_CONF="last_call_timeout=20")
    argv = ["--store", tmp_path / "store", PROBE, out]
    done = _nodes([argv, argv], [env, env], tmp_path)
    assert [p.returncode for p in done] == [0, 0], [p.stderr[-1500:] for p in done]
    seen = _ranks_seen(out)
    assert sorted(seen) == [0, 1, 2, 3] and all(s["sum"] == 4 and s["GROUP_WORLD_SIZE"] == "2" for s in seen.values())
    assert {s["TORCHELASTIC_RUN_ID"] for s in seen.values()} == {"elastic"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_job_on_two_nodes_launched_by_pet_variables_over_s3_matches_the_oracle(tmp_path, s3_store, monkeypatch):
    port = _free_port()
    argv = _trainer_v2_argv(s3_store, ["-m", "alpha_ckpt.job", CONFIG, "--updates", "2", *SMALL])
    done = _nodes([argv, argv], [_trainer_v2_environment(k, port) for k in (0, 1)], tmp_path)
    assert [p.returncode for p in done] == [0, 0], [p.stderr[-1500:] for p in done]
    result = launch.last_json(done[0].stdout)  # the static rendezvous: owner 0 is on node 0
    assert result["owners"] == 4
    assert result["state_digest"] == launch.oracle_digest(CONFIG, "--updates", "2", "--placements", "4", *SMALL)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_rank_killed_on_one_of_two_nodes_of_two_ranks_restarts_both_into_the_newest_generation(tmp_path):
    straight = launch.alpha_run("--nproc", "4", "--store", tmp_path / "straight", *SMALL, "--updates", "6", CONFIG)
    assert straight.returncode == 0, straight.stderr[-2000:]
    port = _free_port()
    argv = ["--nnodes", "2", "--nproc", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "restarts", "--max-restarts", "1", "--store", tmp_path / "shared", *SMALL, "--updates", "6",
            "--checkpoint-every", "2", "--timeout", "30", CONFIG]
    # Owner 3 SIGKILLs itself after update 3 of the first attempt, once update 2 published.
    env = dict(os.environ, ALPHA_CKPT_KILL_OWNER="3:3:0")
    done = _nodes([argv, argv], [env, env], tmp_path, timeout=300)
    assert [p.returncode for p in done] == [0, 0], [p.stderr[-2000:] for p in done]
    (printed,) = [p.stdout for p in done if p.stdout.strip()]
    result = launch.last_json(printed)
    assert (result["update"], result["epoch"], result["owners"]) == (6, 1, 4)
    assert result["state_digest"] == launch.last_json(straight.stdout)["state_digest"]
