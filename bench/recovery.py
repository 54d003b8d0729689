"""Benchmark: recovery from a SIGKILLed rank, alpha-run with the memory tier against torchrun + DCP.

Two sections, chosen with ``--section`` (default ``all``):

  recovery  a GPT-style DDP job (bench/recovery_train.py) on 2 and 4 gloo ranks
            (``--ranks``) loses one rank and is restarted by its launcher; the seconds from
            the SIGKILL to the first completed step after it, per method
  stall     the same model on ``--stall-ranks`` ranks (bench/recovery_stall.py): the
            training stall of one save, the memory tier's against our asynchronous save and
            DCP's ``async_save``, and the host memory the tier holds

Section "recovery"
------------------
The training script builds a GPT of about ``--params`` parameters (8 layers, vocabulary 8192,
context 64, the width chosen to fit), AdamW with two param groups, a warmup LambdaLR, a
DataLoader over a DistributedSampler and per-rank Python, NumPy and torch generators, and saves
every step. In the first attempt the last rank, right after the save of step ``--kill-after`` and
``--settle`` seconds (the job in its steady state: a spare started after the first step is ready),
writes ``time.time()`` to a file and SIGKILLs itself; the launcher sees it, stops the other ranks
and starts all of them again (``--max-restarts 1``), and they resume from the newest checkpoint.
Every rank logs, as JSON lines, when it started (before importing torch), had imported, joined
the process group, built the model, restored and completed each step.

  recovery time = max over ranks of (first step completed in the restarted attempt) - kill time

and its parts, each from the slowest rank's timestamps, add up to it: ``relaunch`` (from the kill
to the restarted script's first line: the launcher's detection, teardown and new processes; under
alpha-run this includes importing alpha_ckpt and torch, which its runner does before the script),
``import``, ``rendezvous`` (init_process_group), ``build`` (model, optimizer, data), ``restore`` and
``first_step``. Methods, alternating within each repetition (a balanced order, see
bench/common.py: every method follows every other equally often):

  torchrun-dcp      ``torchrun --standalone --nproc-per-node N --max-restarts 1 script --ckpt dcp``:
                    dcp.save / dcp.load of a Stateful over get_state_dict / set_state_dict, one
                    directory per step, the newest with a ``.metadata`` resumed (what a torchtitan
                    user writes). Run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: under plain torchrun
                    a restart can otherwise hang in the rendezvous (pytorch#135712), and the
                    baseline is not to be charged a hang.
  alpha-run         ``alpha-run --nproc N --store DIR --max-restarts 1 script --ckpt alpha``:
                    ``Checkpointer.from_launcher_env()``, every save durable.
  alpha-run-memory  ``alpha-run ... --memory --durable-every K ... --ckpt alpha-memory``:
                    ``from_launcher_env(memory=True, durable_every=K)`` (``--durable-every``,
                    default: only the first save is durable), the tier's holders in alpha-run's
                    directory under /dev/shm; the restart restores from memory.
  alpha-run-memory-inplace  the same with ``alpha-run --in-place`` and the script's training
                    function called through ``alpha_ckpt.run_resilient``: only the killed rank is
                    started again, the others leave the broken group and call it again in their
                    own processes (for them ``relaunch`` ends, and ``import`` and ``rendezvous``
                    are nothing, when the function is entered again). Its replacement is today's
                    default warm spare (``--spares 1``), which imported torch only.
  alpha-run-memory-spares  the same, with the model, AdamW and the scheduler built in
                    ``run_resilient``'s ``prepare``: the waiting spare (``--spares 1``) built them
                    before the kill, and survivors keep theirs (for the spare, ``relaunch`` ends
                    when it enters the training function with its rank).

Every run uses OMP_NUM_THREADS=1 (torchrun's default), so a step costs the same under both
launchers. A run that has not finished after ``--run-timeout`` seconds is killed and counted as
hung. Each recovery is checked: every rank resumed at the killed step, and the loss of the first
step after it is the same, rank by rank, for every method (they restore the same state).
Reported per rank count and method: the median recovery seconds, the ratio to torchrun-dcp
(target for alpha-run-memory: at most 0.3), the median parts, and what the restore read.

Section "stall"
---------------
After a training step one method saves the model and AdamW state; the stall is the time inside
the save call, the save is then drained untimed:

  memory      ``Checkpointer(memory=DIR)``: a save that goes to host memory only (publish into
              this rank's holder, copies to one peer), synchronous
  memory-async  the same with ``save="async"``: the stall is the snapshot, the publish and the
              copies run on the save thread
  ours-async  ``Checkpointer(save="async")`` to the store: the stall is the snapshot
  dcp-async   ``dcp.async_save`` of get_state_dict's state, on a gloo group of its own

and the host memory the tier holds: ``last_save["memory_held_bytes"]`` over all ranks and the
bytes of the /dev/shm holders, against the state's size.

Beside both, the raw disk rate: one file of the state's size written with one reused 16 MiB
buffer and one fsync (bench/methods.py's RawDisk), GB/s.

Output: one table per section, then one JSON line. ``--quick``: a small model (2e6 parameters),
2 ranks, one repetition: a smoke test in about a minute.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from .record import REPO_ROOT
from .recovery_parse import (
    PARTS, RECOVERY_METHODS, BASELINE, read_logs, recovery_of)

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "recovery_train.py")
STALL = os.path.join(HERE, "recovery_stall.py")
TARGET = 0.3  # alpha-run-memory's recovery against torchrun-dcp's, at most


def parse_args(argv=None) -> argparse.Namespace:
    doc = (__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(prog="python -m bench recovery", description=doc)
    p.add_argument("--section", choices=["recovery", "stall", "all"], default="all")
    p.add_argument("--params", type=float, default=100e6, help="model size (default 100e6)")
    p.add_argument("--ranks", default="2,4", help="rank counts of the recovery section (default 2,4)")
    p.add_argument("--reps", type=int, default=3, help="repetitions per rank count (default 3)")
    p.add_argument("--methods", default=",".join(RECOVERY_METHODS))
    p.add_argument("--kill-after", type=int, default=3, help="the step after whose save a rank is killed")
    p.add_argument("--settle", type=float, default=8.0,
                   help="seconds the killed rank waits after that save before it dies, in every method: the job "
                        "in its steady state (spares started after the first step have imported and built) "
                        "(default 8)")
    p.add_argument("--durable-every", type=int, default=1000, help="alpha-run-memory: one save in K goes to the store")
    p.add_argument("--stall-ranks", type=int, default=2)
    p.add_argument("--stall-reps", type=int, default=5)
    p.add_argument("--stall-methods", default="memory,memory-async,ours-async,dcp-async",
                   help="the stall section's methods (at 100M parameters on 23 GiB: one memory method per run)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds before a run counts as hung")
    p.add_argument("--dir", default=None, help="working directory (default: a temp dir, removed at the end)")
    p.add_argument("--quick", action="store_true", help="smoke test: --params 2e6 --ranks 2 --reps 1 --stall-reps 2")
    args = p.parse_args(argv)
    if args.quick:
        args.params, args.ranks, args.reps, args.stall_reps = 2e6, "2", 1, 2
    args.rank_counts = [int(x) for x in str(args.ranks).split(",") if x]
    args.method_list = [m for m in args.methods.split(",") if m]
    unknown = set(args.method_list) - set(RECOVERY_METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; known: {', '.join(RECOVERY_METHODS)}")
    return args


def run_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(method: str, n: int, work: str, args: argparse.Namespace) -> list[str]:
    script = [TRAIN, "--dir", os.path.join(work, "ckpt"), "--log-dir", os.path.join(work, "logs"),
              "--params", str(args.params), "--kill-after", str(args.kill_after), "--settle", str(args.settle)]
    if method == "torchrun-dcp":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                "--max-restarts", "1", *script, "--ckpt", "dcp"]
    launcher = [sys.executable, "-m", "alpha_ckpt.launch.launcher", "--nproc", str(n), "--store", os.path.join(work, "ckpt"),
                "--standalone", "--max-restarts", "1"]
    if method == "alpha-run":
        return [*launcher, *script, "--ckpt", "alpha"]
    inplace = method in ("alpha-run-memory-inplace", "alpha-run-memory-spares")
    if inplace:
        launcher.remove("--standalone")  # it hosts its own rendezvous
        launcher += ["--in-place", "--spares", "1"]
    return [*launcher, "--memory", "--durable-every", str(args.durable_every),
            *script, "--ckpt", "alpha-" + method[len("alpha-run-"):], "--durable-every", str(args.durable_every)]


def run_once(method: str, n: int, top: str, tag: str, args: argparse.Namespace) -> dict:
    """One job of ``method`` on ``n`` ranks, killed once and restarted; its recovery (see recovery_of)."""
    work = os.path.join(top, tag)
    os.makedirs(os.path.join(work, "logs"))
    cmd = launch_command(method, n, work, args)
    with open(os.path.join(work, "launcher.log"), "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=run_env(), cwd=work,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own session: it and its ranks
            proc.wait()
            rc = None
    result = recovery_of(read_logs(os.path.join(work, "logs")), n, args.kill_after)
    result.update(rc=rc, hung=rc is None)
    if rc != 0 and not result.get("error"):
        result["error"] = f"exit status {rc}"
    if result.get("error"):
        with open(os.path.join(work, "launcher.log"), "rb") as f:
            result["launcher_tail"] = f.read()[-1500:].decode("utf-8", "replace")
    result["ckpt_bytes"] = tree_bytes(os.path.join(work, "ckpt"))
    shutil.rmtree(work, ignore_errors=True)
    subprocess.run(["sync"], check=False)
    return result


def tree_bytes(path: str) -> int:
    total = 0
    for where, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(where, name)).st_size
            except FileNotFoundError:
                pass
    return total


def raw_disk_GBps(top: str, nbytes: int) -> float:
    """A file of ``nbytes`` written from one reused 16 MiB buffer, one fsync (dd conv=fsync)."""
    import torch
    from .methods import RawDisk
    raw = RawDisk({"x": torch.randn(4 << 20)}, nbytes)
    t0 = time.perf_counter()
    path = raw.save(None, top, 0, name="raw.bin")
    seconds = time.perf_counter() - t0
    os.unlink(path)
    return nbytes / 1e9 / seconds


def state_bytes(params: float) -> int:
    """Model and AdamW's two moments, float32: what one rank's checkpoint holds (about)."""
    from .recovery_train import model_parameters, width_for
    return 3 * 4 * model_parameters(width_for(params))


def median(xs):
    import statistics
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run_recovery(args: argparse.Namespace, top: str) -> dict:
    from .common import balanced_orders
    orders = balanced_orders(args.method_list)
    runs: dict = {}
    for n in args.rank_counts:
        runs[n] = {m: [] for m in args.method_list}
        for rep in range(args.reps):
            for method in orders[rep % len(orders)]:
                r = run_once(method, n, top, f"{method}-{n}-{rep}", args)
                runs[n][method].append(r)
                print(f"# {n} ranks, rep {rep}, {method}: "
                      + (f"{r['recovery_s']:.2f} s" if r.get("recovery_s") is not None else f"FAILED {r.get('error')}"),
                      file=sys.stderr, flush=True)
    return summarize_recovery(args, runs)


def summarize_recovery(args: argparse.Namespace, runs: dict) -> dict:
    summary = {}
    for n, by_method in runs.items():
        rows = {}
        for method, rs in by_method.items():
            ok = [r for r in rs if r.get("recovery_s") is not None and not r.get("error")]
            rows[method] = {
                "recovery_s": [r.get("recovery_s") for r in rs],
                "median_s": median([r["recovery_s"] for r in ok]),
                "parts_median_s": {p: median([r["parts_s"][p] for r in ok]) for p in PARTS},
                "restored": ok[-1]["restored"] if ok else None,
                "failed": [r.get("error") for r in rs if r not in ok],
                "hung": sum(1 for r in rs if r.get("hung")),
                "ckpt_bytes": ok[-1]["ckpt_bytes"] if ok else None,
                "launcher_tail": [r["launcher_tail"] for r in rs if r.get("launcher_tail")][:1],
            }
        base = rows.get(BASELINE, {}).get("median_s")
        for method, row in rows.items():
            row["ratio_to_torchrun_dcp"] = (row["median_s"] / base if base and row["median_s"] is not None else None)
        # every method restores the same state: the first loss after the kill agrees across methods and reps
        losses = {json.dumps(r["first_losses"]) for rs in by_method.values() for r in rs if r.get("first_losses")}
        summary[str(n)] = {"methods": rows, "same_first_loss_after_recovery": len(losses) == 1}
    return summary


def print_recovery(summary: dict, params: int) -> None:
    print(f"\nRecovery: SIGKILL of one rank to the first completed step after it (GPT, {params / 1e6:.1f}M params, "
          "AdamW, DDP gloo); median seconds")
    header = f"{'ranks':>5} {'method':<18} {'recovery':>9} {'ratio':>6}  " + " ".join(f"{p:>10}" for p in PARTS) + \
        "  restored from"
    print(header)
    for n, block in summary.items():
        for method, row in block["methods"].items():
            med = row["median_s"]
            ratio = row["ratio_to_torchrun_dcp"]
            parts = " ".join(f"{row['parts_median_s'][p]:10.2f}" if row["parts_median_s"][p] is not None else
                             f"{'-':>10}" for p in PARTS)
            got = row["restored"] or {}
            where = (f"{got.get('tier')}: {fmt_bytes(got.get('bytes_from_store'))} store, "
                     f"{fmt_bytes(got.get('bytes_from_peers'))} peers" if got.get("bytes_read") is not None
                     else str(got.get("tier")))
            bad = f"  FAILED {len(row['failed'])} (hung {row['hung']})" if row["failed"] else ""
            print(f"{n:>5} {method:<18} {med if med is not None else float('nan'):9.2f} "
                  f"{ratio if ratio is not None else float('nan'):6.3f}  {parts}  {where}{bad}")
        if not block["same_first_loss_after_recovery"]:
            print(f"{n:>5} WARNING: the first loss after recovery differs between methods")
    for n, block in summary.items():
        ratio = block["methods"].get("alpha-run-memory", {}).get("ratio_to_torchrun_dcp")
        if ratio is not None:
            print(f"  {n} ranks: alpha-run-memory / torchrun-dcp = {ratio:.3f}   target <= {TARGET}  "
                  f"{'MET' if ratio <= TARGET else 'MISSED'}")


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def run_stall(args: argparse.Namespace, top: str, shm_top: str) -> dict:
    work = os.path.join(top, "stall")
    os.makedirs(work)
    out = os.path.join(work, "result.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.stall_ranks),
           STALL, "--dir", work, "--memory-dir", os.path.join(shm_top, "stall"), "--params", str(args.params),
           "--reps", str(args.stall_reps), "--out", out, "--methods", args.stall_methods]
    run = subprocess.run(cmd, env=run_env(), capture_output=True, text=True, timeout=args.run_timeout)
    shutil.rmtree(os.path.join(shm_top, "stall"), ignore_errors=True)
    if run.returncode != 0:
        raise SystemExit(f"stall section failed ({run.returncode}):\n{run.stderr[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    shutil.rmtree(work, ignore_errors=True)
    result["median_stall_s"] = {m: median([max(per_rank) for per_rank in rounds])
                                for m, rounds in result["stalls_s"].items()}
    base = result["median_stall_s"].get("dcp-async")
    result["ratio_to_dcp_async"] = {m: (v / base if base else None) for m, v in result["median_stall_s"].items()}
    return result


def print_stall(result: dict) -> None:
    print(f"\nStall of one save ({result['world']} ranks, {result['params'] / 1e6:.1f}M params, state "
          f"{fmt_bytes(result['state_bytes_per_rank'])} per rank); median over saves of the slowest rank")
    print(f"{'method':<14} {'stall s':>9} {'/ dcp-async':>12}")
    for m, v in result["median_stall_s"].items():
        print(f"{m:<14} {v:9.3f} {result['ratio_to_dcp_async'][m]:12.3f}")
    total_state = result["state_bytes_per_rank"] * result["world"]
    if not result.get("memory_held_by"):
        return
    print(f"memory tier holds {fmt_bytes(result['memory_held_bytes_all_ranks'])} over {result['world']} ranks "
          f"(last_save memory_held_bytes of {result['memory_held_by']}), its /dev/shm holders {fmt_bytes(result['memory_dir_bytes'])}, "
          f"against a state of {fmt_bytes(total_state)} over the ranks "
          f"({result['memory_held_bytes_all_ranks'] / total_state:.2f}x)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    from .common import default_base_dir
    from .recovery_train import model_parameters, width_for
    base = args.dir or default_base_dir()
    top = tempfile.mkdtemp(prefix="bench-recovery-", dir=base)
    shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    shm_top = tempfile.mkdtemp(prefix="bench-recovery-", dir=shm_parent)
    params = model_parameters(width_for(args.params))
    result: dict = {"benchmark": "recovery", "params": params,
                    "config": {k: v for k, v in vars(args).items() if k not in ("rank_counts", "method_list")}}
    try:
        result["raw_disk_GBps"] = raw_disk_GBps(top, state_bytes(args.params))
        if args.section in ("recovery", "all"):
            result["recovery"] = run_recovery(args, top)
        if args.section in ("stall", "all"):
            result["stall"] = run_stall(args, top, shm_top)
        result["raw_disk_GBps_after"] = raw_disk_GBps(top, state_bytes(args.params))
    finally:
        shutil.rmtree(top, ignore_errors=True)
        shutil.rmtree(shm_top, ignore_errors=True)
    if "recovery" in result:
        print_recovery(result["recovery"], params)
    if "stall" in result:
        print_stall(result["stall"])
    print(f"\nraw disk (write + fsync of {fmt_bytes(state_bytes(args.params))}): "
          f"{result['raw_disk_GBps']:.2f} GB/s before, {result['raw_disk_GBps_after']:.2f} GB/s after")
    return result


if __name__ == "__main__":
    main()
