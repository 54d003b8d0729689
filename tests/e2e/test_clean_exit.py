"""A script that returns normally exits 0 under plain torchrun and alpha-run, whatever alpha_ckpt opened.

The abort this guards against ("terminate called without an active exception", SIGABRT after the
script returned): a gloo worker thread releases a finished collective's tensors on its own thread,
which takes the GIL; if the interpreter is finalizing by then, Python ends that thread inside a C++
destructor and the process aborts (alpha_ckpt/runtime/teardown.py). alpha_ckpt's exit handler waits, with the
GIL released, until every gloo worker is idle; alpha-run's ranks end with os._exit once the script's
threads are joined and its atexit handlers have run. gates/exit_clean launches every door at 3 ranks
under both launchers, with torch's own writer and reader as the control (50 launches a door on demand).

Also: importing alpha_ckpt starts no thread and installs no signal handler, and a rank that
alpha-run starts binds its life to the launcher itself (it dies when the launcher is killed).
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]

CHECKPOINTER_DOOR = """
import sys
import torch
import torch.distributed as dist
from alpha_ckpt import Checkpointer

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
ckpt = Checkpointer(sys.argv[1], run="exit", publisher=sys.argv[2])
ckpt.restore({"model": model}, "latest")
for step in range(1, 3):
    ckpt.save({"model": model}, update=step)
ckpt.wait()  # no close(), no destroy_process_group()
"""


def torchrun(script: Path, nproc: int, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--standalone", str(script), *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _exits(tmp_path: Path, runs: int) -> list[tuple[int, str]]:
    script = tmp_path / "checkpointer.py"
    script.write_text(CHECKPOINTER_DOOR)
    failed = []
    for i in range(runs):
        done = torchrun(script, 2, tmp_path / f"s{i}", "star" if i % 2 == 0 else "tree", cwd=tmp_path)
        if done.returncode != 0:
            failed.append((done.returncode, done.stderr[-4000:]))
    return failed


@pytest.mark.timeout(300)
def test_a_checkpointer_script_without_close_exits_0_under_torchrun_every_time(tmp_path):
    assert _exits(tmp_path, 4) == []


def record_message_tensors(rank, world, store, publisher):
    """Every tensor handed to a send or broadcast while saving and restoring: does it own its memory?"""
    import torch
    import torch.distributed as dist
    from alpha_ckpt import Checkpointer
    from alpha_ckpt.tiers.durable.wire import broadcast_json
    seen = []

    def recording(send):
        def wrapped(tensor, *args, **kwargs):
            seen.append(tensor.untyped_storage().resizable())  # frombuffer's storage never is
            return send(tensor, *args, **kwargs)
        return wrapped
    dist.send, dist.broadcast, dist.isend = recording(dist.send), recording(dist.broadcast), recording(dist.isend)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ckpt = Checkpointer(store, run="owned", publisher=publisher)
    ckpt.save({"model": model}, update=1)
    ckpt.restore({"model": model}, "latest")
    broadcast_json({"a": 1} if rank == 0 else None, 0)
    ckpt.close()
    return {"sent": len(seen), "owned": all(seen)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("publisher", ["star", "tree"])
def test_every_message_tensor_owns_its_memory(tmp_path, publisher):
    results = run_ranks(2, record_message_tensors, str(tmp_path / "s"), publisher, tmp=tmp_path)
    assert all(r["sent"] > 0 and r["owned"] for r in results), results


def settle_while_a_collective_is_in_flight(rank, world):
    """Rank 0 settles its gloo workers while a broadcast from rank 1 is still on its way."""
    import torch
    import torch.distributed as dist
    from alpha_ckpt.runtime.teardown import settle_gloo_workers
    if rank == 1:
        time.sleep(1.0)
        dist.broadcast(torch.ones(1024), src=1)
        return {}
    buf = torch.zeros(1024)
    work = dist.broadcast(buf, src=1, async_op=True)
    del buf  # only the worker holds the tensor now: releasing it takes the GIL on the worker's thread
    started = time.monotonic()
    settled = settle_gloo_workers(limit_s=60)
    return {"settled": settled, "completed": work.is_completed(), "waited": time.monotonic() - started}


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_settling_waits_with_the_gil_released_until_a_gloo_collective_in_flight_is_done(tmp_path):
    settled = run_ranks(2, settle_while_a_collective_is_in_flight, tmp=tmp_path)[0]
    assert settled["settled"] and settled["completed"], settled
    assert settled["waited"] >= 0.5, settled  # rank 1 sent after a second: the settle did not return early


def gloo_workers_after_close(rank, world, store):
    """gloo worker threads of this process: before a Checkpointer, with it (an async one makes a group of its
    own), and after its close()."""
    import torch
    import torch.distributed as dist
    from alpha_ckpt import Checkpointer
    from alpha_ckpt.testing.launch import wait_until

    def workers() -> int:
        names = []
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    names.append(f.read().strip())
            except OSError:
                pass
        return names.count("pt_gloo_runloop")
    # A worker names itself once it runs: wait until every worker of the default group has.
    per_group = dist.group.WORLD._get_backend(torch.device("cpu")).options._threads
    before = wait_until(lambda: workers() == per_group and per_group, timeout=30, what="the default group's workers")
    ckpt = Checkpointer(store, run="groups", save="async")
    ckpt.save({"w": torch.ones(4)}, update=1)
    during = wait_until(lambda: workers() > before and workers(), timeout=30, what="the save group's workers")
    ckpt.close()
    return {"before": before, "during": during, "after": workers()}


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_close_frees_the_checkpointers_own_groups_and_joins_their_gloo_workers(tmp_path):
    for counts in run_ranks(2, gloo_workers_after_close, str(tmp_path / "s"), tmp=tmp_path):
        assert counts["during"] > counts["before"] and counts["after"] == counts["before"], counts


LATE_THREAD = """
import os, sys, threading, time

def finish():
    while threading.main_thread().is_alive():  # the script has returned: the interpreter is exiting
        time.sleep(0.01)
    with open(sys.argv[1], "w") as f:
        f.write("done")

threading.Thread(target=finish).start()  # not a daemon: Python joins it before the process ends
"""


@pytest.mark.timeout(180)
def test_a_script_that_returns_with_a_thread_still_running_finishes_it_under_alpha_run(tmp_path):
    # As `python script.py` would: an async save still in flight on a thread pool (DCP's async_save) too.
    script = tmp_path / "late_thread.py"
    script.write_text(LATE_THREAD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "alpha_ckpt.launch.launcher", "--nproc", "1", "--store", str(tmp_path / "s"),
                           str(script), str(tmp_path / "finished")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "finished").read_text() == "done"


LEFT_AT_EXIT = """
import atexit
import sys
import torch
import torch.distributed as dist

# Registered first, so it runs last: after alpha_ckpt's own exit handler.
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
from alpha_ckpt import Checkpointer
ckpt = Checkpointer(sys.argv[1], run="left")
ckpt.save({"w": torch.ones(3)}, update=1)  # neither close() nor destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_the_gloo_group_a_finished_script_left_alive_is_destroyed_before_the_interpreter_ends(tmp_path):
    script = tmp_path / "left.py"
    script.write_text(LEFT_AT_EXIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "s"), str(tmp_path / "rendezvous")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "initialized at exit: False" in done.stdout


IMPORT_STARTS_NOTHING = """
import atexit, ctypes, json, signal, sys, threading
import torch  # registers exit handlers of its own
before, handlers = signal.getsignal(signal.SIGTERM), atexit._ncallbacks()
import alpha_ckpt
from alpha_ckpt import Checkpointer, CheckpointerOptions  # the lazy names too
death = ctypes.c_int(-1)
ctypes.CDLL(None).prctl(2, ctypes.byref(death), 0, 0, 0)  # PR_GET_PDEATHSIG
print(json.dumps({"threads": threading.active_count(), "exit_handlers": atexit._ncallbacks() - handlers,
                  "sigterm": signal.getsignal(signal.SIGTERM) is before,
                  "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "death": death.value}))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_GET_PDEATHSIG is Linux's")
def test_importing_alpha_ckpt_starts_no_thread_and_installs_no_signal_or_exit_handler_even_when_a_launcher_is_named(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "ALPHA_CKPT_LAUNCHER_PID": str(os.getpid())}
    proc = subprocess.run([sys.executable, "-c", IMPORT_STARTS_NOTHING], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {"threads": 1, "exit_handlers": 0, "sigterm": True, "sigterm_default": True,
                                      "death": 0}


SLEEPER = """
import os, sys, time
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # dead, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_script_rank_dies_when_its_alpha_run_launcher_is_killed(tmp_path):
    # The rank binds to the launcher itself (the script runner, first thing), not on import.
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    pid_file = tmp_path / "rank.pid"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-m", "alpha_ckpt.launch.launcher", "--nproc", "1", "--store",
                                 str(tmp_path / "s"), str(script), str(pid_file)], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        rank = int(pid_file.read_text())
        launcher.kill()  # the launcher alone: torch starts every rank in a session of its own
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(rank) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(rank)
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
