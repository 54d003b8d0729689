"""The training script of the recovery benchmark (``python -m bench recovery``): a GPT-style model under DDP.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 recovery_train.py --ckpt dcp --dir D --log-dir L
    alpha-run --nproc 2 --store D --max-restarts 1 recovery_train.py --ckpt alpha --dir D --log-dir L
    alpha-run --nproc 2 --store D --max-restarts 1 recovery_train.py --ckpt alpha-memory --dir D --log-dir L

AdamW with two param groups, a warmup LambdaLR, a DataLoader over a DistributedSampler and
per-rank Python, NumPy and torch generators, as examples/train_gpt_ddp.py; the model's size
is set by ``--params``. Every step is saved (but the last: nothing resumes from it). In the
first attempt the last rank writes ``time.time()`` to ``kill.json`` after the save of step
``--kill-after`` and SIGKILLs itself. Every rank of every attempt appends JSON lines to
``rank<R>.jsonl`` in ``--log-dir``: when the process started, joined the group, built the
model, restored (with what it read) and completed each step, all as ``time.time()``.
"""
from __future__ import annotations

import time

STARTED = time.time()  # before torch is imported: the import is part of what a restart pays

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

IMPORTED = time.time()

VOCAB, CONTEXT, LAYERS, BATCH = 8192, 64, 8, 2


def width_for(params: float) -> int:
    """The model width (a multiple of 64, at least 64) whose GPT has about ``params`` parameters:
    12 * LAYERS * width^2 in the blocks, and the token embedding and the head, VOCAB * width each."""
    a, b = 12 * LAYERS, 2 * VOCAB
    width = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    return max(64, int(round(width / 64)) * 64)


def model_parameters(width: int) -> int:
    """The exact parameter count of GPT(width)."""
    block = 4 * width * width + 4 * width + 8 * width * width + 5 * width + 4 * width
    return VOCAB * width + CONTEXT * width + LAYERS * block + 2 * width + VOCAB * width


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, max(1, width // 64), dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1))

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), -math.inf), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Parameter(torch.zeros(CONTEXT, width))
        self.blocks, self.ln = nn.Sequential(*(Block(width) for _ in range(LAYERS))), nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos[: idx.shape[1]])))


class Tokens(Dataset):
    def __init__(self, n=256):
        self.data = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=torch.Generator().manual_seed(1234))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        seq = self.data[i].clone()
        seq[random.randrange(CONTEXT)] = int(np.random.randint(VOCAB))  # augmentation: this rank's generators
        return seq


class DataPosition:
    """This rank's place in its share of the data (epoch, batches taken), as in examples/train_gpt_ddp.py."""

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


class Log:
    """This rank's JSON lines, one write and flush each (a SIGKILL loses nothing already logged)."""

    def __init__(self, directory: str, rank: int, attempt: int):
        self.path, self.attempt = os.path.join(directory, f"rank{rank}.jsonl"), attempt

    def __call__(self, event: str, **fields) -> None:
        line = json.dumps({"event": event, "attempt": self.attempt, "t": time.time(), **fields}) + "\n"
        with open(self.path, "a") as f:
            f.write(line)


def dcp_checkpointing(directory, model, optim, sched, data, progress, rank):
    """save(step) and restore() with torch.distributed.checkpoint, as a torchtitan user writes them: a
    Stateful of get_state_dict/set_state_dict, per-rank keys, a directory per step, the newest with a
    .metadata file resumed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    rng_key, data_key, progress_key = f"rng_{rank}", f"data_{rank}", f"progress_{rank}"

    class AppState(Stateful):
        def state_dict(self):
            model_sd, optim_sd = get_state_dict(model, optim)
            rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
            return {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), data_key: data.state_dict(),
                    rng_key: rng, progress_key: dict(progress)}

        def load_state_dict(self, sd):
            set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            sched.load_state_dict(sd["sched"])
            data.load_state_dict(sd[data_key])
            progress.update(sd[progress_key])
            random.setstate(sd[rng_key]["python"])
            np.random.set_state(sd[rng_key]["numpy"])
            torch.set_rng_state(sd[rng_key]["torch"])

    state = {"app": AppState()}

    def save(step: int) -> None:
        dcp.save(state, checkpoint_id=os.path.join(directory, f"step_{step}"))

    def restore() -> dict:
        steps = sorted(int(d[5:]) for d in os.listdir(directory) if d.startswith("step_")
                       and os.path.exists(os.path.join(directory, d, ".metadata"))) if os.path.isdir(directory) else []
        if steps:
            dcp.load(state, checkpoint_id=os.path.join(directory, f"step_{steps[-1]}"))
        return {"tier": "dcp" if steps else None}

    return save, restore, lambda: None


def alpha_checkpointing(memory: str | None, durable_every: int, model, optim, sched, data, progress, world):
    import alpha_ckpt

    options = {"memory": memory, "durable_every": durable_every} if memory else {}
    ckpt = alpha_ckpt.Checkpointer.from_launcher_env(identity={"model": "gpt-bench"}, **options)
    state = {"model": model, "optim": optim, "sched": sched, "data": alpha_ckpt.PerRank(data),
             "rng": alpha_ckpt.PerRank(alpha_ckpt.RNGState()), "progress": alpha_ckpt.PerRank(progress)}

    def save(step: int) -> None:
        ckpt.save(state, update=step, cursor=step * BATCH * world)

    def restore() -> dict:
        ckpt.restore(state)
        read = ckpt.last_restore or {}
        return {k: read.get(k) for k in ("tier", "bytes_read", "bytes_from_peers", "bytes_from_store")}

    return save, restore, ckpt.close


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", choices=["dcp", "alpha", "alpha-memory", "alpha-memory-inplace", "alpha-memory-spares"],
                        required=True)
    parser.add_argument("--dir", required=True, help="dcp: the checkpoint directory (alpha: the store is alpha-run's)")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--params", type=float, default=2e6)
    parser.add_argument("--kill-after", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.0, help="seconds to wait before the kill")
    parser.add_argument("--steps", type=int, default=None, help="default: one step after --kill-after")
    parser.add_argument("--memory-dir", default=None,
                        help="alpha-memory: the holders' directory (default: alpha-run's, or the tier's own)")
    parser.add_argument("--durable-every", type=int, default=1000,
                        help="alpha-memory: one save in this many goes to the store (the first one does)")
    args = parser.parse_args()
    calls = []

    def body(prepared=None):
        train(args, first_call=not calls, prepared=prepared)
        calls.append(1)

    if args.ckpt in ("alpha-memory-inplace", "alpha-memory-spares"):
        import alpha_ckpt
        # survivors call body() again in their processes; with prepare, a spare builds the model before a kill
        alpha_ckpt.run_resilient(body, backend="gloo",
                                 prepare=(lambda: build(args.params)) if args.ckpt == "alpha-memory-spares" else None)
    else:
        dist.init_process_group("gloo")
        body()
        dist.destroy_process_group()


def build(params: float) -> dict:
    """The model, AdamW and the scheduler (nothing of them depends on the rank)."""
    width = width_for(params)
    torch.manual_seed(0)
    module = GPT(width)
    decay = [p for p in module.parameters() if p.dim() >= 2]
    no_decay = [p for p in module.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 4))
    return {"module": module, "optim": optim, "sched": sched, "width": width}


def train(args, first_call: bool, prepared: dict | None = None):
    """One attempt: build, restore the newest checkpoint, train. In a survivor of an in-place recovery
    this is called again in the same process: its restart starts here, not at the process's start. So
    it does in a spare that prepared the model before the kill and took the killed rank's number."""
    entered = time.time()
    steps = args.steps or args.kill_after + 1
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = Log(args.log_dir, rank, attempt)
    fresh = first_call and not (prepared is not None and attempt > 0)
    log("started", t=STARTED if fresh else entered)
    log("imported", t=IMPORTED if fresh else entered)
    log("joined", t=entered)

    built = prepared or build(args.params)
    width, optim, sched = built["width"], built["optim"], built["sched"]
    model = DistributedDataParallel(built["module"])
    data = DataPosition(Tokens(), rank, world, batch=BATCH)
    torch.manual_seed(100 + rank), random.seed(100 + rank), np.random.seed(100 + rank)
    progress = {"step": 0}
    log("built", params=sum(p.numel() for p in model.parameters()), width=width)

    if args.ckpt == "dcp":
        save, restore, close = dcp_checkpointing(args.dir, model, optim, sched, data, progress, rank)
    else:
        memory = (args.memory_dir or True) if args.ckpt.startswith("alpha-memory") else None
        save, restore, close = alpha_checkpointing(memory, args.durable_every, model, optim, sched, data, progress,
                                                   world)
    read = restore()
    log("restored", step=progress["step"], **read)

    while progress["step"] < steps:
        seq = next(data)
        loss = nn.functional.cross_entropy(model(seq[:, :-1]).reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        progress["step"] += 1
        log("step", step=progress["step"], loss=loss.item())
        if progress["step"] < steps:  # nothing resumes from the last step's save
            save(progress["step"])
            log("saved", step=progress["step"])
        if progress["step"] == args.kill_after and rank == world - 1 and attempt == 0:
            time.sleep(args.settle)
            with open(os.path.join(args.log_dir, "kill.json"), "w") as f:
                f.write(json.dumps({"t": time.time(), "rank": rank, "step": progress["step"]}))
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
    close()


if __name__ == "__main__":
    main()
