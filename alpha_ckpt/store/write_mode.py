"""How a store writes its large objects: buffered or with O_DIRECT, chosen by a learner it owns.

A :class:`WriteModes` is the one place the choice is made and measured. A
:class:`~alpha_ckpt.store.Store` owns one (``store.write_modes``), made from its
``write_mode=`` argument, or shares one passed in its place: stores opened on the
same file system in one process may share what was measured. Nothing is kept
per process: a learner's measurements live and die with it.
"""
from __future__ import annotations

from alpha_ckpt.errors import StoreUsageError

WRITE_MODES = ("auto", "buffered", "direct")
# Buffered unless told otherwise: a buffered save leaves its shards in the page cache, so the restore
# users make most (a restart on the same node) reads memory, not the device; "auto", wherever it
# measured O_DIRECT faster and took it, lost those hot restores (docs/bench-log/2026-12.md). "auto" stays for
# disks shared with other jobs, where O_DIRECT can write faster.
DEFAULT_WRITE_MODE = "buffered"
# Files of one batched commit (a save's shards) written at once, as DCP's thread_count. A buffered
# write spends its time in the kernel filling page cache, and writes side by side overlap those waits
# (the measurements: docs/bench-log/2026-12.md). Each thread holds at most one compressed shard.
DEFAULT_WRITE_THREADS = 4
EXPLORE_EVERY = 8  # under "auto", after this many large writes in one mode, one in the other
# Under "auto", O_DIRECT is chosen only when it writes at least this much faster than buffered: an
# O_DIRECT object is not left in the page cache, so a restore soon after the save (a restart on the
# same node) reads it from the device, while the two modes' saves measured within noise.
DIRECT_MARGIN = 1.25


def check_write_threads(threads: object) -> int:
    """``threads`` if it is a positive int (files of one batch written at once); StoreUsageError if not."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise StoreUsageError(f"write_threads={threads!r}: a positive number of files written at once")
    return threads


class WriteModes:
    """The write-mode learner of a store: which mode the next large write takes, and what it is based on.

    ``mode`` is "buffered" (the default), "direct" (always O_DIRECT) or "auto"
    (chosen by measurement, see :meth:`next`). Measurements are kept per
    number of concurrent writers. Not thread-safe beyond what one save's
    writer thread needs: a store's saves record one batch at a time.
    """

    def __init__(self, mode: str = DEFAULT_WRITE_MODE):
        if mode not in WRITE_MODES:
            raise StoreUsageError(f"write_mode={mode!r}: choose from {', '.join(WRITE_MODES)}")
        self.mode = mode
        self._direct_refused = False  # the file system refused O_DIRECT: written buffered from then on
        self._by_writers: dict[int, dict] = {}

    def for_next_object(self, writers: int = 1) -> str:
        """'direct' or 'buffered' for the next large object: chosen by measurement, per number of
        concurrent writers.

        Under "auto" the first large writes alternate between the two modes;
        after two of each, the one with the higher median throughput (write,
        hash and fsync of real objects) is used, O_DIRECT only where it is
        :data:`DIRECT_MARGIN` times faster, and measuring goes on for
        both: after :data:`EXPLORE_EVERY` writes in one mode the next is made in
        the other, so two unlucky early measurements cannot lock in the slower
        mode, and a change of the disk's behaviour is followed. A file system
        that refuses O_DIRECT is written buffered.

        ``writers`` is how many processes write to the store at once in the
        caller's save (the ranks of a collective save, 1 for one process). Each
        count is measured on its own: one writer's throughput alone and with
        three others beside it are not comparable samples, and the faster mode
        alone need not be the faster one under contention.
        """
        return self.next(writers)[0]

    def next(self, writers: int = 1, agreed: str | None = None) -> tuple[str, bool]:
        """(mode, probe): the next large write's mode, as :meth:`for_next_object` chooses it,
        and whether that write is a probe of a mode (the first alternating ones, or the one after
        :data:`EXPLORE_EVERY` in the other mode), which a writer keeps small. ``agreed`` (a collective
        save's :meth:`for_save`) replaces this learner's own choice, not a probe, a forced mode or
        a refusal of O_DIRECT."""
        if self.mode != "auto":
            return self.mode, False
        if self._direct_refused:
            return "buffered", False
        stats = self._stats(writers)
        seen = {m: len(v) for m, v in stats["gbps"].items()}
        if min(seen.values()) < 2:
            return ("direct" if seen["direct"] <= seen["buffered"] else "buffered"), True
        recent = stats["modes"][-EXPLORE_EVERY:]
        if len(recent) == EXPLORE_EVERY and len(set(recent)) == 1:
            return ("buffered" if recent[0] == "direct" else "direct"), True
        if agreed is not None:
            return agreed, False
        medians = {m: sorted(v[-5:])[len(v[-5:]) // 2] for m, v in stats["gbps"].items()}
        return ("direct" if medians["direct"] >= DIRECT_MARGIN * medians["buffered"] else "buffered"), False

    def for_save(self, writers: int) -> str:
        """The mode for every rank of a collective save to use, as this (the coordinator's) learner would
        choose it now; buffered while it probes (it has no choice yet): each rank still makes its own
        probes first, in the same order on every rank, and writes the rest of the save buffered. So a
        save is in one mode beyond its probes, a save whose ranks all write in one mode gives the
        coordinator a measurement of that mode under the save's whole contention, and a restore
        after a buffered save finds every rank's shards in the page cache."""
        mode, probe = self.next(writers)
        return "buffered" if probe else mode

    def record(self, mode: str, nbytes: int, seconds: float, refused: bool = False, writers: int = 1) -> None:
        """Learn from one batch of large writes: ``nbytes`` in ``seconds`` in ``mode`` with ``writers``
        writing at once; ``refused``: the file system refused O_DIRECT (it is written buffered from now on)."""
        if refused:
            self._direct_refused = True
        elif seconds > 0:
            stats = self._stats(writers)
            stats["gbps"][mode].append(nbytes / seconds / 1e9)
            stats["modes"].append(mode)

    def measured_bytes_per_s(self, writers: int = 1) -> float | None:
        """The median measured throughput of one writer's large object writes, with ``writers`` writing
        at once (None before any)."""
        rates = sorted(r for v in self._stats(writers)["gbps"].values() for r in v[-5:])
        return rates[len(rates) // 2] * 1e9 if rates else None

    def stats(self, writers: int = 1) -> dict:
        """What the choice with ``writers`` writing at once is based on (throughputs in GB/s per mode,
        newest last)."""
        stats = self._stats(writers)
        return {"direct_refused": self._direct_refused,
                "gbps": {m: list(v) for m, v in stats["gbps"].items()},
                "modes": list(stats["modes"]), "next": self.for_next_object(writers)}

    @property
    def direct_refused(self) -> bool:
        """Whether the file system refused O_DIRECT (large objects are then written buffered)."""
        return self._direct_refused

    def _stats(self, writers: int) -> dict:
        if isinstance(writers, bool) or not isinstance(writers, int) or writers < 1:
            raise StoreUsageError(f"writers is a positive int, not {writers!r}")
        return self._by_writers.setdefault(writers, {"gbps": {"direct": [], "buffered": []}, "modes": []})
