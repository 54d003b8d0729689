"""The end-to-end demo job: save, list, verify and restore one generation.

Until the multi-owner launcher lands, ``alpha-run`` runs this single-owner
job: it builds the state of a small forecasting model with its Adam
optimizer state, publishes it to the store, lists and verifies it with the
``alpha-ckpt`` commands, restores it into fresh tensors, checks that every
tensor came back bit for bit, and prints one JSON line.
"""
from __future__ import annotations

import argparse
import io
import json
import sys

import torch

from . import cli, load, save


def demo_state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(90, 64), torch.nn.ReLU(), torch.nn.Linear(64, 7))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    features = torch.randn(256, 90, generator=gen)
    target = torch.randn(256, 7, generator=gen)
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(features), target)
        loss.backward()
        optimizer.step()
    state = {"model": dict(model.state_dict())}
    opt = optimizer.state_dict()["state"]
    state["optimizer"] = {str(k): {n: v for n, v in s.items()} for k, s in opt.items()}
    state["metrics"] = {"loss_sum": loss.detach().double().reshape(()), "samples": torch.tensor(3 * 256)}
    return state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="alpha-run", description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="./alpha-store", help="store directory (default ./alpha-store)")
    parser.add_argument("--run", default="demo")
    parser.add_argument("--step", default="fit")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    state = demo_state(args.seed)
    root = save(state, store=args.store, run=args.run, step=args.step, update=3, cursor=3 * 256, epoch=0,
                metadata={"job": "demo", "seed": args.seed})
    print(f"saved generation {root}", file=sys.stderr)
    for command in (["list", "--store", args.store, "--run", args.run, "--step", args.step],
                    ["verify", "--store", args.store, root]):
        buf = io.StringIO()
        rc = cli.main(command, out=buf)
        sys.stderr.write(buf.getvalue())
        if rc != cli.EXIT_OK:
            return rc
    fresh = torch.utils._pytree.tree_map(lambda t: torch.zeros_like(t), state)
    counters = load(fresh, store=args.store, digest=root)
    leaves = zip(torch.utils._pytree.tree_leaves(state), torch.utils._pytree.tree_leaves(fresh))
    exact = all(torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b) for a, b in leaves)
    print(json.dumps({"root": root, "update": counters.update, "cursor": counters.cursor, "epoch": counters.epoch,
                      "restored_bit_exact": exact}))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
