"""A Checkpointer's save or restore called on some ranks only fails within the group's timeout with
CollectiveIncomplete naming the ranks that did not come, not with gloo's own error, and never hangs."""
import json
import multiprocessing
import os
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

TIMEOUT_S = 3.0  # the group's timeout


def _rank(case: str, rank: int, world: int, rendezvous: str, store: str, out: str, caller_out: str) -> None:
    import torch
    import torch.distributed as dist
    import alpha_ckpt
    from alpha_ckpt.testing.launch import wait_until
    result: dict = {}
    pid_file = Path(store).parent / "rank1.pid"  # the exiting case: rank 1 tells rank 0 which process to watch
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=TIMEOUT_S))
        save = "async" if case == "async-save-on-rank-0" else "sync"
        ckpt = alpha_ckpt.Checkpointer(store, run="r", save=save)
        state = {"w": torch.arange(4.0)}
        started = time.monotonic()
        try:
            if case == "save-on-rank-0" and rank == 0:
                ckpt.save(state, update=1)
            elif case == "async-save-on-rank-0" and rank == 0:
                ckpt.save(state, update=1)
                ckpt.wait()  # the publish runs on the save thread; its failure is raised here
            elif case == "restore-on-rank-1" and rank == 1:
                ckpt.restore(state)
            elif case == "save-on-rank-0-while-rank-1-exits" and rank == 0:
                wait_until(lambda: exited(int(pid_file.read_text())) if pid_file.exists() else False,
                           timeout=60, what="rank 1's exit")
                ckpt.save(state, update=1)
            elif case == "save-on-rank-0-while-rank-1-exits":
                pid_file.write_text(str(os.getpid()))
                os._exit(0)
            else:  # busy elsewhere, alive, until the caller has its answer (or a minute)
                deadline = time.monotonic() + 60
                while not os.path.exists(caller_out) and time.monotonic() < deadline:
                    time.sleep(0.05)
            result = {"raised": None}
        except Exception as exc:  # noqa: BLE001 - what the call raised is the result
            result = {"raised": type(exc).__name__, "missing": getattr(exc, "missing", None), "message": str(exc)}
        result["seconds"] = time.monotonic() - started
    except BaseException:  # noqa: BLE001
        result = {"crash": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # the group is broken now: no teardown of it


def exited(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie its parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _run(case: str, tmp: Path) -> list[dict]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "alpha_ckpt", "alpha_ckpt.collective"])
    run = uuid.uuid4().hex[:8]
    outs = [tmp / f"rank{r}-{run}.json" for r in range(2)]
    caller = 1 if case.startswith("restore") else 0
    procs = [ctx.Process(target=_rank, args=(case, r, 2, str(tmp / f"rdv-{run}"), str(tmp / "s"), str(outs[r]),
                                             str(outs[caller]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    return [json.loads(o.read_text()) if o.exists() else {} for o in outs]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case,caller,missing", [
    ("save-on-rank-0", 0, [1]),
    ("restore-on-rank-1", 1, [0]),
    ("save-on-rank-0-while-rank-1-exits", 0, [1]),
    ("async-save-on-rank-0", 0, [1]),
])
def test_a_call_on_some_ranks_only_names_the_ranks_that_did_not_come_within_the_groups_timeout(
        tmp_path, case, caller, missing):
    results = _run(case, tmp_path)
    assert not any("crash" in r for r in results), results
    got = results[caller]
    assert (got["raised"], got["missing"]) == ("CollectiveIncomplete", missing), got
    assert got["seconds"] < TIMEOUT_S + 10, got  # the group's timeout (not torch's 30 minutes for new groups)
