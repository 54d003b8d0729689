"""Restore of replicated state (DDP's: every rank holds every tensor) on one node: each object read once per
node against every rank reading all of it, and DCP's own load, on the file system and on S3.

``--ranks`` rank processes on gloo (default 4) hold the same ``--size-mib`` MiB (default 256) of float32
tensors (16 of them). Each store (``--stores``, default ``fs,s3``) gets one save of ours (a Checkpointer,
star) and one of DCP's (``dcp.save``: ``FileSystemWriter`` on the file system, ``FsspecWriter`` on s3fs for
S3), untimed. Then each round restores with every method in the benchmark's balanced orders into tensors
poisoned with NaN, checks them with ``torch.equal``, and times the slowest rank (a barrier closes each
phase; readers and Checkpointers are built before the timer).

  shared        ``Checkpointer(share_reads=True)`` (the default): ``restore(root="latest")``; each object
                is read from the store by one rank of the node and mapped by the others
  each          ``Checkpointer(share_reads=False)``: every rank reads and checks all it restores
  dcp           ``dcp.load`` with ``FileSystemReader`` (file system) or ``FsspecReader`` on s3fs (S3)

The file system store is warm in the page cache (the bench just wrote it, as a restart's restore reads
a checkpoint written minutes before); the S3 server is a local SeaweedFS (``weed mini``), as in the ``s3``
suite. The raw disk's write rate is measured once in the run and printed beside the figures.

    python -m bench replicated-restore --rounds 5                   # the BENCHMARKS.md row
    python -m bench replicated-restore --stores fs --size-mib 32 --rounds 1   # smoke run

S3 needs ``pip install -e '.[bench-s3]'`` (for s3fs); without it, the S3 store is left out and the run
says so.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .common import MiB, balanced_orders, default_base_dir
from .ranks import fork_ranks
from .recovery import raw_disk_GBps

TENSORS = 16
METHODS = ("shared", "each", "dcp")
BUCKET = "bench"


def state(size_mib: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    words = size_mib * MiB // 4 // TENSORS
    return {f"layer{i}.weight": torch.randn(words, generator=g) for i in range(TENSORS)}


class Location:
    """Where one store's checkpoints live: ours (a store URL or directory) and DCP's."""

    def __init__(self, kind: str, top: str, endpoint: str | None):
        self.kind, self.endpoint = kind, endpoint
        if kind == "fs":
            self.ours, self.dcp = os.path.join(top, "ours"), os.path.join(top, "dcp")
        else:
            self.ours, self.dcp = f"s3://{BUCKET}/ours", f"s3://{BUCKET}/dcp"

    def dcp_writer(self):
        if self.kind == "fs":
            return dcp.FileSystemWriter(self.dcp)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
        return FsspecWriter(self.dcp, endpoint_url=self.endpoint)

    def dcp_reader(self):
        if self.kind == "fs":
            return dcp.FileSystemReader(self.dcp)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        return FsspecReader(self.dcp, endpoint_url=self.endpoint)


def timed(fn) -> float:
    """``fn`` on every rank between barriers: the slowest rank's seconds."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def rank_main(rank: int, args: argparse.Namespace, world: int, port: int, stores: list[tuple[str, str, str | None]],
              out: multiprocessing.Queue) -> None:
    import alpha_ckpt
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.rank_timeout))
    src, dst = state(args.size_mib, 0), state(args.size_mib, 1)
    times: dict = {}
    orders = balanced_orders(METHODS)
    for kind, top, endpoint in stores:
        if endpoint:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
        where = Location(kind, top, endpoint)
        ckpt = alpha_ckpt.Checkpointer(where.ours, run="bench", step="fit", publisher="star")
        ckpt.restore({"model": src}, root=None)
        ckpt.save({"model": src}, update=1, cursor=1)
        ckpt.close()
        dcp.save(src, storage_writer=where.dcp_writer())
        times[kind] = {m: [] for m in METHODS}
        for rnd in range(args.rounds):
            for method in orders[rnd % len(orders)]:
                for t in dst.values():
                    t.fill_(float("nan"))
                if method == "dcp":
                    reader = where.dcp_reader()
                    took = timed(lambda: dcp.load(dst, storage_reader=reader))
                else:
                    ckpt = alpha_ckpt.Checkpointer(where.ours, run="bench", step="fit", share_reads=method == "shared")
                    took = timed(lambda: ckpt.restore({"model": dst}, root="latest"))
                    ckpt.close()
                differ = torch.tensor([sum(not torch.equal(dst[k], src[k]) for k in src)])
                dist.all_reduce(differ)
                if int(differ.item()):
                    raise SystemExit(f"{method} on {kind}, round {rnd + 1}: {int(differ.item())} restored tensor(s) "
                                     "differ from the saved ones")
                if rank == 0:
                    times[kind][method].append(round(took, 4))
                    print(f"  {kind} round {rnd + 1}  {method:<7} restore {took:6.3f} s", flush=True)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench replicated-restore", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="rank processes on this node (default 4)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--size-mib", type=int, default=256, help="the replicated state (default 256)")
    p.add_argument("--stores", default="fs,s3", help="fs, s3 or both (default fs,s3)")
    p.add_argument("--rank-timeout", type=float, default=3600.0)
    p.add_argument("--dir", default=None, help="where the stores (and the S3 server's data) live")
    args = p.parse_args(argv)
    kinds = [k for k in args.stores.split(",") if k]
    if not kinds or any(k not in ("fs", "s3") for k in kinds):
        p.error(f"--stores: fs, s3 or fs,s3, not {args.stores!r}")
    if args.ranks < 2:
        p.error("--ranks: at least 2 (one rank has nothing to share)")
    left_out = []
    if "s3" in kinds:
        try:
            import s3fs  # noqa: F401
        except ImportError as exc:
            kinds.remove("s3")
            left_out.append(f"s3: {exc}")
            print(f"left out (does not import): s3fs ({exc})")
    top = tempfile.mkdtemp(prefix="bench-replicated.", dir=args.dir or default_base_dir())
    server = None
    try:
        stores = []
        if "fs" in kinds:
            stores.append(("fs", os.path.join(top, "fs"), None))
        if "s3" in kinds:
            from alpha_ckpt.testing.s3_server import S3Server
            server = S3Server(os.path.join(top, "server")).start()
            os.environ.update(server.environment())
            server.make_bucket(BUCKET)
            stores.append(("s3", "", server.endpoint))
        disk = raw_disk_GBps(top, args.size_mib * MiB)
        times = fork_ranks(args.ranks, lambda rank, port, out: rank_main(rank, args, args.ranks, port, stores, out),
                           args.rank_timeout, "replicated-restore")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(top, ignore_errors=True)
    return report(args, kinds, times, disk, left_out)


def report(args: argparse.Namespace, kinds: list[str], times: dict, disk: float, left_out: list[str]) -> dict:
    gb = args.size_mib * MiB / 1e9
    print(f"\n{args.size_mib} MiB of replicated tensors on each of {args.ranks} ranks; {args.rounds} round(s); raw disk "
          f"write {disk:.2f} GB/s. Median restore: seconds, and GB/s of the state (each rank restores all of it)")
    figures = {}
    for kind in kinds:
        median = {m: statistics.median(times[kind][m]) for m in METHODS}
        ratios = {"shared / each": median["each"] / median["shared"], "shared / dcp": median["dcp"] / median["shared"]}
        print(f"  {kind}: " + "; ".join(f"{m} {median[m]:.3f} s ({gb / median[m]:.2f} GB/s)" for m in METHODS)
              + "; speed-up of shared: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        figures[kind] = {"median_s": median, "GBps": {m: gb / median[m] for m in METHODS}, "speedup": ratios,
                         "times": times[kind]}
    return {"ranks": args.ranks, "size_mib": args.size_mib, "rounds": args.rounds, "raw_disk_GBps": disk,
            "left_out": left_out, "stores": figures}
