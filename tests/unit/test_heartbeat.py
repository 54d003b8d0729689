"""A rank's heartbeat and the launcher's watch over it (alpha_ckpt/runtime/heartbeat.py)."""
import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alpha_ckpt.runtime import launch_env
from alpha_ckpt.errors import UsageError
from alpha_ckpt.runtime.heartbeat import Silence, Watcher, check_heartbeat_args, kill

ROOT = Path(__file__).resolve().parents[2]


def test_a_process_is_silent_only_past_the_limit_once_it_has_beaten_and_past_startup_before():
    silence = Silence(limit=5.0, startup=20.0)
    assert silence.look({100: 0}, now=0.0) == {}  # watched from here; no beat yet
    assert silence.look({100: 0}, now=19.0) == {}  # starting (python, torch): startup applies
    assert silence.look({100: 0}, now=20.5) == {100: 20.5}
    assert silence.look({100: 1}, now=21.0) == {}  # its first beat: the limit applies from now on
    assert silence.look({100: 1}, now=25.9) == {}
    assert silence.look({100: 1}, now=26.1) == pytest.approx({100: 5.1})
    assert silence.look({100: 2}, now=26.2) == {}  # beating again (a slow rank, continued): not silent


def test_a_pid_seen_with_a_count_already_is_given_startup_and_a_process_gone_is_forgotten():
    silence = Silence(limit=1.0, startup=10.0)
    assert silence.look({7: 40}, now=0.0) == {}  # a reused pid's old counter is no beat of this process
    assert silence.look({7: 40}, now=5.0) == {}
    assert silence.look({}, now=6.0) == {}  # gone
    assert silence.look({7: 40}, now=100.0) == {}  # seen again: watched afresh
    assert silence.look({7: 40}, now=105.0) == {}


def flags(**given):
    args = argparse.Namespace(timeout=120.0, heartbeat_limit=None, heartbeat_period=None)
    for name, value in given.items():
        setattr(args, name, value)
    return args


def test_the_limit_defaults_to_half_the_timeout_and_the_period_to_a_second_or_a_quarter_of_the_limit():
    args = flags()
    check_heartbeat_args(args)
    assert (args.heartbeat_limit, args.heartbeat_period) == (60.0, 1.0)
    args = flags(timeout=4.0)
    check_heartbeat_args(args)
    assert (args.heartbeat_limit, args.heartbeat_period) == (2.0, 0.5)


@pytest.mark.parametrize("given", [
    {"heartbeat_limit": 120.0},  # not below --timeout: a peer's collective would time out first
    {"timeout": 10.0, "heartbeat_limit": 11.0},
    {"heartbeat_limit": 0.0}, {"heartbeat_limit": -1.0}, {"heartbeat_limit": float("nan")},
    {"heartbeat_period": 0.0}, {"heartbeat_period": float("inf")},
    {"heartbeat_limit": 10.0, "heartbeat_period": 6.0},  # more than half the limit
])
def test_heartbeat_flags_that_cannot_be_are_usage_errors(given):
    with pytest.raises(UsageError):
        check_heartbeat_args(flags(**given))


BEATING = """
import sys, time
from alpha_ckpt.runtime import heartbeat
heartbeat.start_from_environment()
print("beating", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP and process groups")
def test_a_stopped_process_stops_beating_is_found_hung_past_the_limit_and_killed_and_a_short_stop_is_not():
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **launch_env.heartbeat_environment(f"127.0.0.1:{store.port}", 0.1)}
    proc = subprocess.Popen([sys.executable, "-c", BEATING], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == "beating\n"
        watcher = Watcher(store, limit=1.5, startup=60.0, check_every=0.0)

        def watch(seconds: float) -> list:
            found, end = [], time.monotonic() + seconds
            while time.monotonic() < end and not found:
                found = watcher.hung({3: proc.pid})
                time.sleep(0.05)
            return found

        assert watch(1.0) == []  # beating
        os.kill(proc.pid, signal.SIGSTOP)
        assert watch(0.6) == []  # stopped less than the limit: left alone
        os.kill(proc.pid, signal.SIGCONT)
        assert watch(2.5) == []  # beating again: its silence is over
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        [hung] = watch(10.0)
        assert (hung.rank, hung.pid) == (3, proc.pid)
        assert 1.5 - 0.1 < time.monotonic() - stopped < 1.5 + 2.0 and hung.silent_s > 1.5
        kill(hung.pid)  # a stopped process dies of SIGKILL as it is
        assert proc.wait(timeout=20) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


BUSY = """
import json, sys, time
import torch
from alpha_ckpt.runtime import heartbeat
torch.set_num_threads(1)
heartbeat.start_from_environment()
print("beating", flush=True)
matrix = torch.randn(4000, 4000)
started = time.monotonic()
matrix @ matrix  # one torch call of seconds: C++ with the GIL released
in_torch = time.monotonic() - started
started, n = time.monotonic(), 0
while time.monotonic() - started < 3:  # pure Python: it holds the GIL but gives it up every few ms
    n += 1
print(json.dumps({"in_torch": in_torch}), flush=True)
time.sleep(60)  # until the test has looked
"""


@pytest.mark.timeout(180)
def test_a_rank_busy_in_one_long_torch_call_or_in_python_keeps_beating():
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **launch_env.heartbeat_environment(f"127.0.0.1:{store.port}", 0.1)}
    proc = subprocess.Popen([sys.executable, "-c", BUSY], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "beating\n"
        watcher = Watcher(store, limit=1.0, startup=60.0, check_every=0.0)
        hung, done = [], []
        while not done and not hung and proc.poll() is None:
            hung = watcher.hung({0: proc.pid})
            if select.select([proc.stdout], [], [], 0.05)[0]:
                done.append(json.loads(proc.stdout.readline()))
        assert hung == [] and done, proc.poll()
        assert done[0]["in_torch"] > 1.0  # the torch call outlasted the limit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


IMPORTS_AND_BEATS = """
import json, os, threading, time
from alpha_ckpt.runtime import heartbeat, launch_env
before = threading.active_count()
beat = heartbeat.start_from_environment()
time.sleep(0.5)
print(json.dumps({"before": before, "during": threading.active_count(), "daemon": beat._thread.daemon,
                  "inherited": launch_env.HEARTBEAT in os.environ, "pid": os.getpid()}))
"""


@pytest.mark.timeout(120)
def test_a_rank_beats_from_a_daemon_thread_its_children_do_not_inherit_and_its_exit_is_clean():
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **launch_env.heartbeat_environment(f"127.0.0.1:{store.port}", 0.05)}
    proc = subprocess.run([sys.executable, "-c", IMPORTS_AND_BEATS], env=env, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-2000:]  # the interpreter's exit stops it cleanly
    seen = json.loads(proc.stdout)
    assert {k: seen[k] for k in ("before", "during", "daemon", "inherited")} == {
        "before": 1, "during": 2, "daemon": True, "inherited": False}
    assert store.add(launch_env.heartbeat_key(seen["pid"]), 0) >= 3  # it beat, every 0.05 s
