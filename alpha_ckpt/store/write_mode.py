"""How large objects are written: buffered or O_DIRECT, and how many files at once."""
from __future__ import annotations

WRITE_MODES = ("auto", "buffered", "direct")
WRITE_MODE_ENV = "ALPHA_CKPT_WRITE_MODE"
# Buffered unless told otherwise: a buffered save leaves its shards in the page cache, so the restore
# users make most (a restart on the same node) reads memory, not the device; with writeback started
# as shards are written, buffered saves of 1 GiB on 2 and 4 ranks met DCP's throughput within noise in
# every run, while "auto", wherever it measured O_DIRECT faster and took it, lost every hot restore
# (0.64-0.88x DCP's). "auto" stays for disks shared with other jobs, where O_DIRECT can write faster.
DEFAULT_WRITE_MODE = "buffered"
WRITE_THREADS_ENV = "ALPHA_CKPT_WRITE_THREADS"
# Files of one batched commit (a save's shards) written at once, as DCP's thread_count. A buffered
# write spends its time in the kernel filling page cache, and writes side by side overlap those waits:
# in paired 30-round probes on 2 cores (1 GiB, 2 and 4 ranks), 2 threads saved 1.03-1.29x faster than
# 1, and 4 1.13-1.15x faster than 2; more than 4 gained less consistently. The benchmark at 4 ranks
# showed no gain over one thread (docs/BENCHMARKS.md). Each thread holds at most one compressed shard.
DEFAULT_WRITE_THREADS = 4
EXPLORE_EVERY = 8  # under "auto", after this many large writes in one mode, one in the other
# Under "auto", O_DIRECT is chosen only when it writes at least this much faster than buffered: an
# O_DIRECT object is not left in the page cache, so a restore soon after the save (a restart on the
# same node) reads it from the device; measured hot at 1 GiB on 2 and 4 ranks, such a restore took
# 0.63-1.28 s against 0.21-0.36 s after a buffered save, while the two modes' saves were within noise.
DIRECT_MARGIN = 1.25
_write_stats: dict[int, dict] = {}  # st_dev -> measured write throughput per writer count and mode, in this process
