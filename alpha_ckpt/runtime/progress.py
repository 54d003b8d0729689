"""Progress bars and structured log events for the long commands (verify, export, gc).

A person at a terminal gets a one-line bar redrawn in place; a log collector
(stderr is a pipe or a file) gets no bar, only one JSON line per command from
:func:`emit`, so logs never fill with carriage returns.

The JSON events are a contract for log collectors (docs/EVENTS.md): every line
carries ``event``, ``version`` and ``time``, and each event named in
:data:`EVENTS` always carries the fields listed there. A new field may be added
within a version; removing or renaming one raises :data:`EVENT_VERSION`.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from typing import IO, Any

BAR_WIDTH = 20
REDRAW_INTERVAL_S = 0.1  # at most ~10 redraws a second: a redraw per chunk would cost more than the work
_clock = time.monotonic  # replaced in tests

EVENT_VERSION = 1
# Every event any command writes, with the fields it always carries (others may come with them).
EVENTS: dict[str, frozenset[str]] = {
    # alpha-ckpt commands: one event when the command ends; outcome is ok, refused (with code),
    # usage-error or error (with error).
    "verify": frozenset({"root", "outcome", "seconds"}),
    "export": frozenset({"root", "format", "path", "outcome", "seconds"}),
    "gc": frozenset({"dry_run", "outcome", "seconds"}),
    # A script's Checkpointer under alpha-run: what restore(state) resumed from, once, from rank 0.
    "restored": frozenset({"run", "step", "update", "root", "bytes_read"}),
    "fresh_start": frozenset({"run", "step"}),
    "recovered": frozenset({"run", "step", "attempt", "failed_rank", "tier", "root", "update", "bytes_from_peers",
                            "bytes_from_store", "restart_s", "rendezvous_s", "restore_s", "first_step_s", "total_s"}),
    # A script's Checkpointer: each save, from rank 0, with the tier it went to (memory or durable).
    "checkpoint_saved": frozenset({"run", "step", "update", "root", "tier", "seconds"}),
    # The forecasting job, from owner 0.
    "publish": frozenset({"run", "step", "root", "mode", "owners", "update", "generation", "bytes",
                          "bytes_written", "seconds", "stall_s"}),
    "checkpoint_skipped": frozenset({"update", "reason"}),
    "checkpoint_interval": frozenset({"cost_s", "mtbf_s", "interval_s", "cost_source", "update_s", "every_updates",
                                     "update", "tier"}),
    "checkpoints_discarded": frozenset({"run", "step", "generations", "objects", "pinned"}),
}


def is_tty(stream: IO[str] | None) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed or detached stream is not a terminal
        return False


def emit(event: str, stream: IO[str] | None = None, **fields: Any) -> None:
    """Write one JSON line ``{"event": event, "version": EVENT_VERSION, "time": <unix seconds>, ...fields}``
    and flush it. An event not in :data:`EVENTS`, or one missing a field it promises, is a bug: TypeError."""
    if {"event", "version", "time"} & fields.keys():
        raise TypeError("'event', 'version' and 'time' are set by emit itself")
    promised = EVENTS.get(event)
    if promised is None:
        raise TypeError(f"unknown event {event!r}: add it to EVENTS and docs/EVENTS.md")
    if not promised <= fields.keys():
        raise TypeError(f"event {event!r} lacks {sorted(promised - fields.keys())}")
    stream = sys.stderr if stream is None else stream
    line = json.dumps({"event": event, "version": EVENT_VERSION, "time": time.time(), **fields}, sort_keys=True,
                      allow_nan=False)
    stream.write(line + "\n")
    stream.flush()


def format_bytes(n: float) -> str:
    """Binary units, one decimal: 512.0 MiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    """Decimal units, as disks and the benchmarks quote them: 1.8 GB/s."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.1f} {unit}"
    return f"{bytes_per_s:.0f} B/s"


class Progress:
    """A byte-count bar on a terminal, nothing elsewhere.

    ``advance`` may be called from several threads (the verifiers hash in
    parallel). Leaving the context draws the final state and a newline on a
    terminal and emits nothing; callers log their own event.
    """

    def __init__(self, label: str, total_bytes: int, stream: IO[str] | None = None):
        self.label = label
        self.total_bytes = max(0, int(total_bytes))
        self.done_bytes = 0
        self.stream = sys.stderr if stream is None else stream
        self.tty = is_tty(self.stream)
        self._lock = threading.Lock()
        self._started = _clock()
        self._last_draw: float | None = None
        self._drawn_width = 0

    def __enter__(self) -> "Progress":
        self._started = _clock()
        if self.tty:
            with self._lock:
                self._draw(self._started)
        return self

    def advance(self, nbytes: int) -> None:
        with self._lock:
            self.done_bytes += nbytes
            if not self.tty:
                return
            now = _clock()
            if self._last_draw is None or now - self._last_draw >= REDRAW_INTERVAL_S:
                self._draw(now)

    def __exit__(self, *exc) -> None:
        if self.tty:
            with self._lock:
                self._draw(_clock())
                self.stream.write("\n")
                self.stream.flush()

    def line(self, now: float | None = None) -> str:
        now = _clock() if now is None else now
        # A total is an estimate for some callers (file headers): never show more done than the total.
        done = min(self.done_bytes, self.total_bytes)
        filled = int(BAR_WIDTH * done / self.total_bytes) if self.total_bytes else BAR_WIDTH
        elapsed = now - self._started
        rate = format_rate(self.done_bytes / elapsed) if elapsed > 0 else "--"
        return (f"{self.label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                f"{format_bytes(done)} / {format_bytes(self.total_bytes)}  {rate}")

    def _draw(self, now: float) -> None:
        text = self.line(now)
        # Pad over the previous line's tail: it may have been longer.
        self.stream.write("\r" + text.ljust(self._drawn_width))
        self.stream.flush()
        self._drawn_width = len(text)
        self._last_draw = now
