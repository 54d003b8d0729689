"""Sharded save and restore on an S3 server: ours against DCP through fsspec/s3fs, s3torchconnector and a raw client.

One local SeaweedFS server (``weed mini``, as the tests start it) serves every method in one run. For each
world size of ``--ranks`` (default 1, 2 and 4), rank processes on gloo hold ``--size-mib`` MiB (default
1 GiB) of ``Shard(0)`` DTensors (16 float32 matrices of 1024 columns, as FSDP2 holds parameters and
moments). Each round, every method in turn, in the benchmark's balanced orders, saves the state under a
fresh prefix, restores it into NaN-poisoned DTensors, checks it with ``torch.equal`` and deletes the
prefix. Times are the slowest rank's (a barrier closes each phase); each method's writer, reader or
Checkpointer is built before its timer, as a script builds it once.

  ours          ``alpha_ckpt.Checkpointer("s3://BUCKET/PREFIX", publisher="star")``: save; a new
                Checkpointer's ``restore(root="latest")``
  dcp-s3fs[-tN] ``dcp.save`` / ``dcp.load`` with DCP's ``FsspecWriter`` / ``FsspecReader`` on s3fs;
                ``-tN``: the writer's ``thread_count`` (DCP's default: 1)
  s3torch[-tN]  ``dcp.save`` / ``dcp.load`` with s3torchconnector's ``S3StorageWriter`` /
                ``S3StorageReader`` (its defaults; ``-tN``: the writer's ``thread_count``, default 1)
  raw           the limit: boto3 as it comes, each rank one object of its own bytes by multipart
                upload (16 MiB parts, 8 at a time, straight from the tensors) and ranged GETs
                (16 MiB, 8 at a time) back into the tensors; no hashing, no commit, no collective

Requests are counted by a proxy in front of the server (``alpha_ckpt.testing.s3_proxy``), as the
server sees them, in one untimed round per world size before the timed ones: PUT, GET, HEAD, POST,
DELETE and LIST per save and per restore, and what building the writer or reader cost. The timed
rounds go to the server directly, so the proxy's own cost is in no time.

The server keeps its data in ``--dir`` (default: a new directory under /work or /tmp); the raw disk's
write rate there is measured once in the run and printed beside the figures.

    python -m bench s3 --ranks 1,2,4 --rounds 5                        # 1 GiB, the BENCHMARKS.md row
    python -m bench s3 --ranks 2 --rounds 1 --size-mib 64              # smoke run

Needs the benchmark's S3 peers: ``pip install -e '.[bench-s3]'``. A peer that does not import is
left out, and the run says so.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import re
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .checkpointer_rank import row_sharded_matrices
from .common import MiB, balanced_orders, default_base_dir, prefault
from .ranks import fork_ranks
from .recovery import raw_disk_GBps

COLS, MATRICES = 1024, 16
BUCKET = "bench"
METHOD = re.compile(r"^(?P<kind>ours|raw|dcp-s3fs|s3torch)(?:-t(?P<threads>[1-9]\d*))?$")
PEERS = ("dcp-s3fs", "s3torch")
RAW_PART_BYTES, RAW_THREADS = 16 * MiB, 8
COUNTED = ("PUT", "GET", "HEAD", "POST", "DELETE", "LIST")
REGION = "us-east-1"  # s3torchconnector's clients want one; the local server takes any


def method_kind(method: str) -> tuple[str, int | None]:
    m = METHOD.match(method)
    if m is None or (m["threads"] and m["kind"] in ("ours", "raw")):
        raise ValueError(method)
    return m["kind"], int(m["threads"]) if m["threads"] else None


def peer_missing(kind: str) -> str | None:
    """Why a peer cannot run here (it does not import), or None."""
    try:
        if kind == "dcp-s3fs":
            import s3fs  # noqa: F401
        elif kind == "s3torch":
            import s3torchconnector.dcp  # noqa: F401
    except ImportError as exc:
        return f"{kind}: {exc}"
    return None


def boto_client(endpoint: str):
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=2 * RAW_THREADS))


# --- the raw client: each rank's bytes as one object --------------------------------------------------

def byte_segments(tensors: list[torch.Tensor]) -> list[tuple[int, memoryview]]:
    """(offset, bytes) of each tensor in one object holding them end to end."""
    out, at = [], 0
    for t in tensors:
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        out.append((at, view))
        at += len(view)
    return out


def pieces(segments: list[tuple[int, memoryview]], start: int, end: int) -> list[memoryview]:
    """The views of bytes [start, end) of the object ``segments`` describe."""
    out = []
    for at, view in segments:
        lo, hi = max(start, at), min(end, at + len(view))
        if lo < hi:
            out.append(view[lo - at:hi - at])
    return out


def ranges(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + RAW_PART_BYTES, size)) for a in range(0, size, RAW_PART_BYTES)]


def raw_save(client, key: str, tensors: list[torch.Tensor]) -> None:
    segments = byte_segments(tensors)
    size = segments[-1][0] + len(segments[-1][1])
    upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]

    def part(number_range):
        number, (a, b) = number_range
        body = b"".join(pieces(segments, a, b))
        return {"PartNumber": number, "ETag": client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload,
                                                                 PartNumber=number, Body=body)["ETag"]}
    with ThreadPoolExecutor(RAW_THREADS) as pool:
        parts = list(pool.map(part, enumerate(ranges(size), start=1)))
    client.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})


def raw_restore(client, key: str, tensors: list[torch.Tensor]) -> None:
    segments = byte_segments(tensors)
    size = segments[-1][0] + len(segments[-1][1])

    def fetch(span):
        a, b = span
        data = memoryview(client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={a}-{b - 1}")["Body"].read())
        at = 0
        for view in pieces(segments, a, b):
            view[:] = data[at:at + len(view)]
            at += len(view)
    with ThreadPoolExecutor(RAW_THREADS) as pool:
        list(pool.map(fetch, ranges(size)))


# --- one method's save and restore --------------------------------------------------------------------

class Method:
    """One method's save and restore under ``prefix`` against ``endpoint``: ``open_save`` / ``open_restore``
    build what the phase needs (untimed), ``save`` / ``restore`` run it (timed)."""

    def __init__(self, method: str, endpoint: str, prefix: str, rank: int):
        self.kind, self.threads = method_kind(method)
        self.endpoint, self.prefix, self.rank = endpoint, prefix, rank
        self.url = f"s3://{BUCKET}/{prefix}"
        self.handle = None

    def open_save(self, state: dict) -> None:
        os.environ["AWS_ENDPOINT_URL"] = self.endpoint  # how ours and s3fs's botocore find the server
        if self.kind == "ours":
            import alpha_ckpt
            self.handle = alpha_ckpt.Checkpointer(self.url, run="bench", step="fit", save="sync", publisher="star")
            self.handle.restore({"model": state}, root=None)  # a fresh start (collective)
        elif self.kind == "dcp-s3fs":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
            self.handle = FsspecWriter(self.url, thread_count=self.threads or 1, endpoint_url=self.endpoint)
        elif self.kind == "s3torch":
            from s3torchconnector.dcp import S3StorageWriter
            self.handle = S3StorageWriter(REGION, self.url, thread_count=self.threads or 1)
            self.handle.fs = s3torch_fs(self.endpoint)
        else:
            self.handle = boto_client(self.endpoint)

    def save(self, state: dict) -> None:
        if self.kind == "ours":
            self.handle.save({"model": state}, update=1, cursor=1)
        elif self.kind == "raw":
            raw_save(self.handle, f"{self.prefix}/rank-{self.rank}", [t.to_local() for t in state.values()])
        else:
            dcp.save(state, storage_writer=self.handle)

    def open_restore(self) -> None:
        os.environ["AWS_ENDPOINT_URL"] = self.endpoint
        if self.kind == "ours":
            import alpha_ckpt
            self.handle = alpha_ckpt.Checkpointer(self.url, run="bench", step="fit", publisher="star")
        elif self.kind == "dcp-s3fs":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
            self.handle = FsspecReader(self.url, endpoint_url=self.endpoint)
        elif self.kind == "s3torch":
            from s3torchconnector.dcp import S3StorageReader
            self.handle = S3StorageReader(REGION, self.url)
            self.handle.fs = s3torch_fs(self.endpoint, self.handle._reader_constructor)
        else:
            self.handle = boto_client(self.endpoint)

    def close(self) -> None:
        if self.kind == "ours":
            self.handle.close()

    def restore(self, dest: dict) -> None:
        if self.kind == "ours":
            self.handle.restore({"model": dest}, root="latest")
        elif self.kind == "raw":
            raw_restore(self.handle, f"{self.prefix}/rank-{self.rank}", [t.to_local() for t in dest.values()])
        else:
            dcp.load(dest, storage_reader=self.handle)


def s3torch_fs(endpoint: str, reader_constructor=None):
    """s3torchconnector's DCP file system on ``endpoint``: its writer and reader take a region and no
    endpoint, so the bench hands them a file system over a client built with one (path-style addressing,
    as a local server needs)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem
    config = S3ClientConfig(force_path_style=True)
    return S3FileSystem(REGION, s3_client=S3Client(REGION, endpoint=endpoint, s3client_config=config),
                        reader_constructor=reader_constructor)


def delete_prefix(client, prefix: str) -> int:
    """Remove every object and multipart upload under ``prefix``; how many objects there were."""
    removed = 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})
            removed += len(keys)
    for upload in client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix + "/").get("Uploads", []):
        client.abort_multipart_upload(Bucket=BUCKET, Key=upload["Key"], UploadId=upload["UploadId"])
    return removed


# --- rank processes -----------------------------------------------------------------------------------

def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def phase(fn, proxy=None) -> tuple[float, dict | None]:
    """Run ``fn`` on every rank between barriers: (the slowest rank's seconds, the proxy's counts or None)."""
    if proxy is not None:  # before the barrier: a rank let through first must not send before the reset
        proxy.reset()
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    dist.barrier()
    counts = None if proxy is None else {k: proxy.counts.get(k, 0) for k in COUNTED}
    return slowest(took), counts


def rank_main(rank: int, args: argparse.Namespace, world: int, port: int, server: str,
              out: multiprocessing.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.rank_timeout))
    from torch.distributed.device_mesh import init_device_mesh
    shape = (args.size_mib * MiB // (4 * MATRICES * COLS), COLS)
    mesh = init_device_mesh("cpu", (world,))
    src, dst = (side[0] for side in row_sharded_matrices(shape, MATRICES, {0: mesh}, seed=0))
    own_bytes = sum(t.to_local().nbytes for t in src.values())
    cleaner = boto_client(server) if rank == 0 else None

    # The counting round goes through a proxy in rank 0's process; the others learn its port.
    proxy = None
    if rank == 0:
        from alpha_ckpt.testing.s3_proxy import S3Proxy
        proxy = S3Proxy(server).start()
    proxy_port = torch.tensor([int(proxy.endpoint.rsplit(":", 1)[1]) if proxy else 0])
    dist.broadcast(proxy_port, 0)
    via_proxy = f"http://127.0.0.1:{int(proxy_port.item())}"

    times = {m: {"save": [], "restore": []} for m in args.methods}
    requests: dict = {}
    orders = balanced_orders(args.methods)
    for rnd in range(-1, args.rounds):  # round -1: counted through the proxy, untimed
        for method in (args.methods if rnd < 0 else orders[rnd % len(orders)]):
            counted = rnd < 0
            m = Method(method, via_proxy if counted else server, f"{method}/w{world}/r{rnd + 1}", rank)
            _, open_save = phase(lambda: m.open_save(src), proxy if counted else None)
            prefault(int(args.prefault * own_bytes))
            save_s, save_n = phase(lambda: m.save(src), proxy if counted else None)
            m.close()
            for t in dst.values():
                t.to_local().fill_(float("nan"))
            _, open_restore = phase(m.open_restore, proxy if counted else None)
            prefault(int(args.prefault * own_bytes))
            restore_s, restore_n = phase(lambda: m.restore(dst), proxy if counted else None)
            m.close()
            differ = torch.tensor([sum(not torch.equal(dst[k].to_local(), src[k].to_local()) for k in src)])
            dist.all_reduce(differ)
            if int(differ.item()):
                raise SystemExit(f"{method}, {world} rank(s), round {rnd + 1}: {int(differ.item())} restored "
                                 "tensor(s) differ from the saved ones")
            dist.barrier()
            if rank == 0:
                objects = delete_prefix(cleaner, m.prefix)
                if counted:
                    requests[method] = {"open_save": open_save, "save": save_n, "open_restore": open_restore,
                                        "restore": restore_n, "objects": objects}
                else:
                    times[method]["save"].append(round(save_s, 4))
                    times[method]["restore"].append(round(restore_s, 4))
                    print(f"  {world} rank(s) round {rnd + 1}  {method:<12} save {save_s:6.3f} s   "
                          f"restore {restore_s:6.3f} s", flush=True)
            dist.barrier()
    if rank == 0:
        proxy.stop()
        out.put({"times": times, "requests": requests})
    dist.destroy_process_group()


def launch(args: argparse.Namespace, world: int, server: str) -> dict:
    return fork_ranks(world, lambda rank, port, out: rank_main(rank, args, world, port, server, out),
                      args.rank_timeout, "s3 suite")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench s3", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1,2,4", help="world sizes, comma-separated (default 1,2,4)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per world size (default 5)")
    p.add_argument("--size-mib", type=int, default=1024, help="the whole state (default 1024)")
    p.add_argument("--methods", nargs="+", default=["ours", "raw", "dcp-s3fs", "s3torch"])
    p.add_argument("--prefault", type=float, default=2.0, help="times each rank's bytes (default 2, as the others)")
    p.add_argument("--rank-timeout", type=float, default=3600.0)
    p.add_argument("--dir", default=None, help="where the server keeps its data")
    args = p.parse_args(argv)
    try:
        worlds = [int(w) for w in args.ranks.split(",")]
    except ValueError:
        p.error(f"--ranks: comma-separated world sizes, not {args.ranks!r}")
    for method in args.methods:
        try:
            method_kind(method)
        except ValueError:
            p.error(f"--methods: ours, raw, dcp-s3fs[-tN], s3torch[-tN] (not {method!r})")
    if "ours" not in args.methods or "raw" not in args.methods or len(set(args.methods)) != len(args.methods):
        p.error("--methods: ours and raw, and no method twice")
    for world in worlds:
        if world < 1 or args.size_mib * MiB % (4 * MATRICES * COLS * world):
            p.error(f"--size-mib {args.size_mib} does not give whole rows to {world} rank(s)")
    left_out = [why for why in (peer_missing(method_kind(m)[0]) for m in args.methods) if why]
    args.methods = [m for m in args.methods if peer_missing(method_kind(m)[0]) is None]
    for why in left_out:
        print(f"left out (does not import): {why}")

    from alpha_ckpt.testing.s3_server import S3Server
    top = tempfile.mkdtemp(prefix="bench-s3.", dir=args.dir or default_base_dir())
    server = S3Server(os.path.join(top, "server")).start()
    os.environ.update(server.environment())
    try:
        server.make_bucket(BUCKET)
        disk = raw_disk_GBps(top, args.size_mib * MiB)
        results = {}
        for world in worlds:
            results[world] = launch(args, world, server.endpoint)
    finally:
        server.stop()
        shutil.rmtree(top, ignore_errors=True)
    return report(args, worlds, results, disk, left_out)


def report(args: argparse.Namespace, worlds: list[int], results: dict, disk: float, left_out: list[str]) -> dict:
    gb = args.size_mib * MiB / 1e9
    figures = {}
    print(f"\n{args.size_mib} MiB of Shard(0) DTensors; {args.rounds} timed round(s) per world; raw disk write "
          f"{disk:.2f} GB/s (one file, one fsync, where the server keeps its data)")
    for world in worlds:
        times, requests = results[world]["times"], results[world]["requests"]
        rate = {m: {ph: gb / statistics.median(t[ph]) for ph in ("save", "restore")} for m, t in times.items()}
        peers = [m for m in times if method_kind(m)[0] in PEERS]
        ratios = {}
        for ph in ("save", "restore"):
            ratios[f"{ph} / raw"] = rate["ours"][ph] / rate["raw"][ph]
            if peers:
                best = max(peers, key=lambda m: rate[m][ph])
                ratios[f"{ph} / best peer"] = rate["ours"][ph] / rate[best][ph]
                ratios[f"{ph} best peer"] = best
        print(f"{world} rank(s): median throughput, GB/s (save; restore), and requests per save; per restore")
        for m in times:
            n = requests[m]
            cells = "; ".join(f"{ph} " + " ".join(f"{k} {n[ph][k]}" for k in COUNTED if n[ph][k]) for ph in ("save", "restore"))
            print(f"  {m:<12} {rate[m]['save']:6.2f}; {rate[m]['restore']:6.2f}   {cells}   "
                  f"(building the writer {sum(n['open_save'].values())}, the reader {sum(n['open_restore'].values())} "
                  f"requests; {n['objects']} objects stored)")
        print("  ours: " + ", ".join(f"{k} {v:.2f}x" if isinstance(v, float) else f"{k} {v}" for k, v in ratios.items()))
        figures[world] = {"GBps": rate, "ratios": ratios, "requests": requests, "times": times}
    return {"size_mib": args.size_mib, "rounds": args.rounds, "methods": args.methods, "left_out": left_out,
            "prefault": args.prefault, "raw_disk_GBps": disk, "worlds": figures}
