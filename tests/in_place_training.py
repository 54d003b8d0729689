"""A DDP training script of the tests' GPT (tests/gpt_training.py) whose ranks recover in place
(alpha_ckpt.run_resilient), and that can kill one.

    alpha-run --nproc 2 --max-restarts 1 --in-place --store S tests/in_place_training.py --steps 8 \
        --kill-rank 1 --kill-at 3 --events DIR

AdamW with two param groups, a warmup scheduler, a DistributedSampler's data
position and every rank's own generators (Python, NumPy, torch), a checkpoint
after every step. ``--kill-rank K --kill-at S``: rank K SIGKILLs itself after
step S + R's checkpoint in round R, for each of the first ``--kills`` rounds.
``--kill-rank`` repeated: those ranks die together. ``--prepare``: the model, AdamW and
the scheduler are built once per process in run_resilient's ``prepare`` (a spare builds them before it
takes a rank). ``--kill-spare-at S``: rank 0 SIGKILLs one of
the launcher's waiting spares after step S of the first round. ``--stop-rank K --stop-at S``: rank K stops itself (SIGSTOP) after step S's checkpoint in
the first round, hung for good, or with ``--stop-for SECONDS`` until a process it started
continues it (SIGCONT) that much later. Every call of
main() appends one JSON line per rank to DIR/events-RANK.jsonl (pid, round,
the step it resumed at, the restart context it read), the killed or stopped rank the time it died
or stopped, and each call the
time its first step after the restore completed, and the times it was imported, started main() (the
group joined) and restored. Rank 0 prints the final
state's SHA-256 as one JSON line.
"""
import argparse
import dataclasses
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import alpha_ckpt
from alpha_ckpt.runtime import launch_env
from gpt_training import CONTEXT, GPT, VOCAB  # the tests' one GPT (this script's folder is on the path)


class Tokens(Dataset):
    def __init__(self, n=64):
        self.data = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=torch.Generator().manual_seed(1234))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        seq = self.data[i].clone()
        seq[random.randrange(CONTEXT)] = int(np.random.randint(VOCAB))  # this rank's generators
        return seq


class DataPosition:
    """This rank's place in its share of the data (epoch, batches taken), Stateful."""

    def __init__(self, dataset, rank, world, batch):
        self.dataset, self.batch = dataset, batch
        self.sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=0)
        self.epoch, self.index, self._it = 0, 0, None

    def _start(self):
        self.sampler.set_epoch(self.epoch)
        order = list(self.sampler)[self.index * self.batch:]
        self._it = iter(DataLoader(self.dataset, batch_size=self.batch, sampler=order))

    def __next__(self):
        if self._it is None:
            self._start()
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.index = self.epoch + 1, 0
            self._start()
            batch = next(self._it)
        self.index += 1
        return batch

    def state_dict(self):
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        self.epoch, self.index = state["epoch"], state["index"]
        self._start()


def rank_ordered_mean(group, bucket):
    """DDP's gradient mean, summed in rank order: bit-identical whatever the bucket layout.

    DDP lays out its first step's buckets by parameter order and every later step's by the order the
    gradients became ready; a ring allreduce's summation order follows an element's place in its
    bucket, so on more than 2 ranks the first step after a restart would round differently.
    """
    tensor, world = bucket.buffer(), dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(world)]

    def mean(_):
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total.div_(world)
    return dist.all_gather(parts, tensor, group=group, async_op=True).get_future().then(mean)


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--kill-rank", type=int, action="append", default=[], help="repeat it: those ranks die together")
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--kills", type=int, default=1, help="rounds in which the rank kills itself")
    p.add_argument("--events", default=None)
    p.add_argument("--model-name", default="gpt-in-place", help="the identity's model: another refuses the store's")
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep after every step (compute, simulated)")
    p.add_argument("--stop-rank", type=int, default=-1)
    p.add_argument("--stop-at", type=int, default=0)
    p.add_argument("--stop-for", type=float, default=0.0, help="seconds until SIGCONT (0: stopped for good)")
    p.add_argument("--kill-spare-at", type=int, default=0, help="rank 0 SIGKILLs a waiting spare after this step")
    p.add_argument("--prepare", action="store_true", help="build the model and optimizer in run_resilient's prepare")
    p.add_argument("--read-rank-at-import", action="store_true",
                   help="read RANK before run_resilient (which a spare, rank-less until it takes one, cannot)")
    return p.parse_args()


ARGS = parse()
RANK_AT_IMPORT = int(os.environ["RANK"]) if ARGS.read_rank_at_import else None
CALLS = [0]
IMPORTED = time.time()  # python started, torch and this script imported


def process_started() -> float:
    """When the kernel started this process, on time.time()'s clock: a warm spare began before the
    failure it replaced, a process started for a replacement after it."""
    ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    uptime = float(open("/proc/uptime").read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def waiting_spares() -> list[int]:
    """The pids of the spares this rank's launcher keeps waiting (its children running ``--spare``)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            command = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if ppid == os.getppid() and b"--spare" in command:
            out.append(int(entry))
    return out


def kill_a_spare(rank) -> None:
    deadline = time.monotonic() + 60
    while not waiting_spares():
        assert time.monotonic() < deadline, "no spare started"
        time.sleep(0.05)
    pid = waiting_spares()[0]
    os.kill(pid, signal.SIGKILL)
    record(rank, call=CALLS[0], killed_spare=pid, killed_spare_at=time.time())


def record(rank, **event):
    if ARGS.events:
        with open(os.path.join(ARGS.events, f"events-{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"rank": rank, "pid": os.getpid(), "t": time.time(), **event}) + "\n")


def build():
    """The model, its optimizer and scheduler: nothing of them depends on the rank."""
    torch.manual_seed(0)
    module = GPT()
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))
    return {"module": module, "optim": optim, "sched": sched, "prepared_at": time.time()}


def main(prepared=None):
    CALLS[0] += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    round_ = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if CALLS[0] == 1:
        record(rank, imported=IMPORTED, process_started=process_started(),
               prepared_at=None if prepared is None else prepared["prepared_at"])
    record(rank, call=CALLS[0], main_started=time.time())  # the process group joined
    built = prepared or build()
    model = DistributedDataParallel(built["module"])
    model.register_comm_hook(None, rank_ordered_mean)
    optim, sched = built["optim"], built["sched"]
    data = DataPosition(Tokens(), rank, world, batch=4)
    torch.manual_seed(100 + rank), random.seed(100 + rank), np.random.seed(100 + rank)
    progress = {"step": 0}
    ckpt = alpha_ckpt.Checkpointer.from_launcher_env(identity={"model": ARGS.model_name},
                                                     allow_nonfinite=["*.causal_mask"])
    state = {"model": model, "optim": optim, "sched": sched, "data": alpha_ckpt.PerRank(data),
             "rng": alpha_ckpt.PerRank(alpha_ckpt.RNGState()), "progress": alpha_ckpt.PerRank(progress)}
    ckpt.restore(state)
    context = launch_env.restart_context()
    record(rank, call=CALLS[0], round=round_, resumed_at=progress["step"], restored=time.time(),
           restart=None if context is None else dataclasses.asdict(context))
    first = True
    while progress["step"] < ARGS.steps:
        seq = next(data)
        loss = nn.functional.cross_entropy(model(seq[:, :-1]).reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        progress["step"] += 1
        if first:
            first = False
            record(rank, call=CALLS[0], first_step_done=time.time())
        ckpt.save(state, update=progress["step"], cursor=progress["step"] * 4 * world)
        time.sleep(ARGS.step_seconds)
        if rank == 0 and progress["step"] == ARGS.kill_spare_at and round_ == 0:
            kill_a_spare(rank)
        if rank in ARGS.kill_rank and progress["step"] == ARGS.kill_at + round_ and round_ < ARGS.kills:
            record(rank, call=CALLS[0], killed_at=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == ARGS.stop_rank and progress["step"] == ARGS.stop_at and round_ == 0:
            if ARGS.stop_for:
                subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time; time.sleep(float(sys.argv[1]));"
                                  " os.kill(int(sys.argv[2]), signal.SIGCONT)", str(ARGS.stop_for), str(os.getpid())])
            record(rank, call=CALLS[0], stopped_at=time.time())
            os.kill(os.getpid(), signal.SIGSTOP)
            record(rank, call=CALLS[0], continued_at=time.time())

    digest = hashlib.sha256()
    for t in list(model.state_dict().values()) + [v for s in optim.state_dict()["state"].values() for v in s.values()]:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps([sched.state_dict(), optim.state_dict()["param_groups"]], sort_keys=True,
                             default=str).encode())
    if rank == 0:
        print(json.dumps({"state_sha256": digest.hexdigest(), "step": progress["step"]}), flush=True)
    ckpt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    alpha_ckpt.run_resilient(main, backend="gloo", prepare=build if ARGS.prepare else None)
