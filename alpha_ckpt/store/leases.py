"""Pending-publish leases: what lets gc run beside a publish, even with ``--grace 0``.

    STORE/pending/<pid>-<random>    one small canonical-JSON file per publishing process and run/step

A publish writes its objects before the ref that makes them reachable, so
for a while gc cannot tell them from garbage. Before writing its first
object a publisher takes a lease (:meth:`alpha_ckpt.store.Store.pending_publish`);
it removes the lease once its ref is published or the publish failed. gc
reads the leases before anything else and spares every object modified
after the oldest live lease started (less :data:`CLOCK_SLACK_S`), so neither
the objects a pending publish wrote nor those it reused (a reused object's
modification time is renewed) can go.

A lease is stale when its process is gone (same host: the pid is not alive,
or it now names a process with another start time) or when it is older than
``max(grace, STALE_AFTER_S)``; gc ignores and removes stale leases. A lease
from another host is trusted until it is that old.
"""
from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass
from typing import Callable

from alpha_ckpt.store.durable import file_kind
from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import canonical_json, check_name, parse_canonical_json
from alpha_ckpt.store.layout import PENDING, StoreLayout

PENDING_DIR = PENDING
STALE_AFTER_S = 6 * 3600.0
CLOCK_SLACK_S = 2.0  # file times and time.time() may disagree a little (coarse clocks, a file server's clock)
MAX_LEASE_BYTES = 4096


@dataclass(frozen=True)
class Lease:
    name: str
    run: str
    step: str
    pid: int
    pid_start: int | None  # the process's start time (clock ticks after boot), to tell a reused pid
    host: str
    started_at: float

    def to_bytes(self) -> bytes:
        return canonical_json({"kind": "lease", "run": self.run, "step": self.step, "pid": self.pid,
                               "pid_start": self.pid_start, "host": self.host, "started_at": self.started_at}) + b"\n"

    @classmethod
    def from_bytes(cls, name: str, data: bytes) -> "Lease":
        what = f"lease {name}"
        if not data.endswith(b"\n"):
            raise Refusal(RefusalCode.FORMAT, f"{what}: not one JSON line")
        obj = parse_canonical_json(data[:-1], what)
        keys = {"kind", "run", "step", "pid", "pid_start", "host", "started_at"}
        if not isinstance(obj, dict) or set(obj) != keys or obj["kind"] != "lease":
            raise Refusal(RefusalCode.FORMAT, f"{what}: unexpected lease fields")
        check_name(obj["run"], "run")
        check_name(obj["step"], "step")
        pid, start, started = obj["pid"], obj["pid_start"], obj["started_at"]
        if type(pid) is not int or pid <= 0 or not (start is None or type(start) is int) \
                or type(started) not in (int, float) or not isinstance(obj["host"], str):
            raise Refusal(RefusalCode.FORMAT, f"{what}: bad pid, host or start time")
        return cls(name, obj["run"], obj["step"], pid, start, obj["host"], float(started))


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, from /proc), or None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        # Field 22; the command name (field 2) may hold spaces and parentheses, so count after its last ')'.
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, host: str | None = None, pid_start: int | None = None) -> bool | None:
    """Whether ``pid`` on ``host`` still runs: True, False, or None where this host cannot tell (another host)."""
    if host is not None and host != socket.gethostname():
        return None
    if pid <= 0:
        return False  # never signal a process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    except (OverflowError, ValueError):
        return False
    if pid_start is not None:
        now = process_start(pid)
        if now is not None and now != pid_start:
            return False  # the pid was reused by another process
    return True


def writer_alive(name: str) -> bool:
    """Whether the process that names a temporary file (``<pid>-<random>.tmp``, see durable_commit) runs here."""
    head, sep, _ = name.partition("-")
    return bool(sep) and head.isdigit() and len(head) <= 10 and process_alive(int(head)) is True


def lease_is_stale(lease: Lease, now: float, grace: float) -> bool:
    if now - lease.started_at > max(grace, STALE_AFTER_S):
        return True
    return process_alive(lease.pid, lease.host, lease.pid_start) is False


def read_leases(layout: StoreLayout, on_hostile: Callable[[str, str], None] | None = None,
                ) -> list[tuple[str, Lease | None, float]]:
    """Every lease file of STORE/pending: (name, the lease or None where unreadable or half-written, mtime).

    Leases are regular files; anything else there (a FIFO, a directory, a
    symlink) is no lease: it is skipped unopened, and ``on_hostile(path, why)``
    hears of it. A pending/ that is not a plain directory is refused (gc
    cannot tell which publishes are in flight).
    """
    try:
        dir_fd = layout.open_dir(PENDING_DIR)
    except FileNotFoundError:
        return []
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refusal(RefusalCode.FORMAT, f"store entry {PENDING_DIR} is a symlink or not a directory") from None
        raise
    try:
        return [entry for name in sorted(os.listdir(dir_fd))
                if (entry := _read_lease_entry(dir_fd, name, on_hostile)) is not None]
    finally:
        os.close(dir_fd)


def _read_lease_entry(dir_fd: int, name: str, on_hostile) -> tuple[str, Lease | None, float] | None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None  # released meanwhile
    if not stat.S_ISREG(st.st_mode):
        if on_hostile is not None:
            on_hostile(f"{PENDING_DIR}/{name}", f"a {file_kind(st.st_mode)}, not a lease file")
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError:
        return name, None, st.st_mtime
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None  # replaced meanwhile by something that is no lease
        data = os.pread(fd, MAX_LEASE_BYTES + 1, 0)
    finally:
        os.close(fd)
    lease = None
    if not name.endswith(".tmp") and len(data) <= MAX_LEASE_BYTES:
        try:
            lease = Lease.from_bytes(name, data)
        except Refusal:
            pass
    return name, lease, st.st_mtime
