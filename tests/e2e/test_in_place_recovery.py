"""alpha-run --in-place: a killed rank is replaced alone, the survivors recover in their own processes."""
import json
import shutil
import time
from pathlib import Path

import pytest

from alpha_ckpt.testing import launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "in_place_training.py"
STEPS = 8


def alpha_run(*args, cwd, timeout=240):
    return launch.alpha_run(*args, cwd=cwd, timeout=timeout)


def final_state(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def events(folder: Path) -> dict[int, list[dict]]:
    """rank -> the events its processes recorded, in order."""
    out = {}
    for path in sorted(folder.glob("events-*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        out[lines[0]["rank"]] = lines
    return out


def calls(recorded: list[dict]) -> list[tuple[int, int]]:
    """(pid, call number) of every main() call of one rank."""
    return [(e["pid"], e["call"]) for e in recorded if "resumed_at" in e]


def process_started(recorded: list[dict], pid: int) -> float:
    """When the kernel started the process ``pid`` of one rank (its first record says): a warm spare
    began before the failure it replaced."""
    return next(e["process_started"] for e in recorded if e["pid"] == pid and "process_started" in e)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final state of a run that never stopped, per world size."""
    digests = {}

    def digest(nproc: int) -> str:
        if nproc not in digests:
            tmp = tmp_path_factory.mktemp(f"straight{nproc}")
            proc = alpha_run("--nproc", nproc, "--store", tmp / "s", SCRIPT, "--steps", STEPS, cwd=tmp)
            assert proc.returncode == 0, proc.stderr[-2000:]
            digests[nproc] = final_state(proc)["state_sha256"]
        return digests[nproc]
    return digest


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nproc,killed,at", [(2, 1, 3), (4, 2, 4)])
def test_survivors_keep_their_processes_and_end_bit_identical(tmp_path, uninterrupted, nproc, killed, at):
    (tmp_path / "ev").mkdir()
    proc = alpha_run("--nproc", nproc, "--max-restarts", 1, "--in-place", "--store", tmp_path / "s", SCRIPT,
                     "--steps", STEPS, "--kill-rank", killed, "--kill-at", at, "--events", tmp_path / "ev",
                     cwd=tmp_path, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted(nproc)
    recorded = events(tmp_path / "ev")
    assert sorted(recorded) == list(range(nproc))
    for rank, seen in recorded.items():
        made = calls(seen)
        resumed = [e["resumed_at"] for e in seen if "resumed_at" in e]
        assert resumed == [0, at], (rank, resumed)  # every rank restored the newest generation once
        if rank == killed:
            assert made[0][0] != made[1][0] and made[1][1] == 1, made  # a new process: a replacement
        else:
            assert made == [(made[0][0], 1), (made[0][0], 2)], made  # the same process called main() twice
    replacement = calls(recorded[killed])[1][0]
    assert replacement not in {pid for rank, seen in recorded.items() if rank != killed for pid, _ in calls(seen)}


@pytest.mark.timeout(300)
def test_a_plain_script_under_in_place_is_restarted_whole_in_one_round(tmp_path, uninterrupted):
    # A script that does not call run_resilient dies with its peer; that death belongs to the failure
    # that began the round, so --max-restarts 1 is enough and the result is the same.
    plain = tmp_path / "plain.py"
    resilient = 'alpha_ckpt.run_resilient(main, backend="gloo", prepare=build if ARGS.prepare else None)'
    assert resilient in SCRIPT.read_text()
    plain.write_text(SCRIPT.read_text().replace(resilient, 'dist.init_process_group("gloo")\n    main()'))
    shutil.copy(SCRIPT.parent / "gpt_training.py", tmp_path)  # its model, beside it as beside the original
    (tmp_path / "ev").mkdir()
    proc = alpha_run("--nproc", 2, "--max-restarts", 1, "--in-place", "--store", tmp_path / "s", plain,
                     "--steps", STEPS, "--kill-rank", 1, "--kill-at", 3, "--events", tmp_path / "ev", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted(2)
    for seen in events(tmp_path / "ev").values():
        assert len({pid for pid, _ in calls(seen)}) == 2  # every rank a new process


@pytest.mark.timeout(300)
def test_restarts_that_run_out_exit_75_naming_the_failed_rank(tmp_path):
    proc = alpha_run("--nproc", 2, "--max-restarts", 1, "--in-place", "--store", tmp_path / "s", SCRIPT,
                     "--steps", STEPS, "--kill-rank", 1, "--kill-at", 2, "--kills", 2, cwd=tmp_path)
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "rank 1" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.timeout(300)
def test_a_refusal_under_in_place_exits_3_without_a_restart(tmp_path):
    first = alpha_run("--nproc", 2, "--store", tmp_path / "s", SCRIPT, "--steps", 2, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "ev").mkdir()
    started = time.monotonic()
    # Another model's generation is the newest: every rank's restore refuses it.
    proc = alpha_run("--nproc", 2, "--max-restarts", 3, "--in-place", "--store", tmp_path / "s", SCRIPT,
                     "--steps", STEPS, "--model-name", "another", "--events", tmp_path / "ev", cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]
    recorded = events(tmp_path / "ev")
    assert not [e for seen in recorded.values() for e in seen if "resumed_at" in e]  # none got past the restore
    assert all(len({e["pid"] for e in seen}) == 1 for seen in recorded.values())  # none was started again
    assert time.monotonic() - started < 120


OWN_ERROR = """
import os, sys
import alpha_ckpt


def main():
    with open(os.path.join(sys.argv[1], f"main-{os.environ['RANK']}-{os.getpid()}"), "w"):
        pass
    raise ValueError("hidden size must be positive, not -3")


if __name__ == "__main__":
    alpha_ckpt.run_resilient(main, backend="gloo")
"""


@pytest.mark.timeout(200)
def test_a_scripts_own_error_before_any_checkpoint_call_exits_1_without_a_new_round(tmp_path):
    script = tmp_path / "own_error.py"
    script.write_text(OWN_ERROR)
    (tmp_path / "calls").mkdir()
    proc = alpha_run("--nproc", 2, "--max-restarts", 3, "--in-place", "--store", tmp_path / "s", script,
                     tmp_path / "calls", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert sorted(p.name.split("-")[1] for p in (tmp_path / "calls").iterdir()) == ["0", "1"]  # one call each
    assert "hidden size must be positive, not -3" in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [
    ["--in-place"],  # no --max-restarts
    ["--in-place", "--max-restarts", "0"],
    ["--in-place", "--max-restarts", "1", "--master-port", "29511"],
    ["--in-place", "--max-restarts", "1", "--rdzv-endpoint", "localhost:29400"],
    ["--in-place", "--max-restarts", "1", "--standalone"],
    ["--in-place", "--max-restarts", "1", "--nnodes", "2"],
    ["--in-place", "--max-restarts", "1", "--resume-from", "0" * 64],
])
def test_in_place_usage_errors_exit_2_before_any_rank_starts(tmp_path, flags):
    proc = launch.alpha_run_checks("--nproc", 2, "--store", tmp_path / "s", *flags, SCRIPT, cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


@pytest.mark.timeout(120)
def test_in_place_refuses_the_built_in_job(tmp_path):
    proc = launch.alpha_run_checks("--nproc", 2, "--store", tmp_path / "s", "--updates", 2, "--max-restarts", 1,
                                   "--in-place", ROOT / "configs" / "forecast.toml", cwd=tmp_path)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(400)
def test_with_the_memory_tier_every_rank_recovers_in_place_from_memory_bit_identical(tmp_path, uninterrupted):
    (tmp_path / "ev").mkdir()
    # --durable-every 5 (the default): updates 1 and 6 go to the store, update 5 only to memory.
    proc = alpha_run("--nproc", 2, "--max-restarts", 1, "--in-place", "--memory", "--store", tmp_path / "s", SCRIPT,
                     "--steps", STEPS, "--kill-rank", 1, "--kill-at", 5, "--events", tmp_path / "ev", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted(2)
    for rank, seen in events(tmp_path / "ev").items():
        assert [e["resumed_at"] for e in seen if "resumed_at" in e] == [0, 5], rank  # memory's, newer than the store's
    survivor = calls(events(tmp_path / "ev")[0])
    assert survivor[0][0] == survivor[1][0]
    [recovered] = [json.loads(line) for line in proc.stderr.splitlines()
                   if line.startswith("{") and '"event": "recovered"' in line]
    assert recovered["tier"] == "memory" and recovered["update"] == 5 and recovered["bytes_from_store"] == 0
    assert recovered["failed_rank"] == 1 and 0 <= recovered["restart_s"] < recovered["total_s"]


@pytest.mark.timeout(400)
def test_asynchronous_saves_with_the_memory_tier_recover_in_place_bit_identical(tmp_path, uninterrupted):
    (tmp_path / "ev").mkdir()
    # The rank dies right after save(5) returns: that save's publish may not have finished, so the
    # ranks resume update 5 or the one before it, the same on every rank, and end the same.
    proc = alpha_run("--nproc", 2, "--max-restarts", 1, "--in-place", "--memory", "--save", "async",
                     "--store", tmp_path / "s", SCRIPT, "--steps", STEPS, "--kill-rank", 1, "--kill-at", 5,
                     "--events", tmp_path / "ev", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert final_state(proc)["state_sha256"] == uninterrupted(2)
    recorded = events(tmp_path / "ev")
    resumed = {rank: [e["resumed_at"] for e in seen if "resumed_at" in e] for rank, seen in recorded.items()}
    assert resumed[0] == resumed[1] and resumed[0][0] == 0 and resumed[0][1] in (4, 5), resumed
    survivor = calls(recorded[0])
    assert survivor[0][0] == survivor[1][0]
