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
import tomllib
from pathlib import Path

import torch

from . import cli, load, save


DEFAULT_CONFIG = {"run": "demo", "step": "fit", "seed": 0, "updates": 3, "batch": 256, "history_days": 90,
                  "horizon_days": 7, "hidden": 64, "lr": 1e-3}


def load_config(path: str | None) -> dict:
    config = dict(DEFAULT_CONFIG)
    if path:
        with open(path, "rb") as f:
            given = tomllib.load(f)
        unknown = sorted(set(given) - set(config))
        if unknown:
            raise SystemExit(f"alpha-run: {path}: unknown keys {unknown}")
        config.update(given)
    return config


def demo_state(c: dict) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    model = torch.nn.Sequential(torch.nn.Linear(c["history_days"], c["hidden"]), torch.nn.ReLU(),
                                torch.nn.Linear(c["hidden"], c["horizon_days"]))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    optimizer = torch.optim.Adam(model.parameters(), lr=c["lr"])
    features = torch.randn(c["batch"], c["history_days"], generator=gen)
    target = torch.randn(c["batch"], c["horizon_days"], generator=gen)
    for _ in range(c["updates"]):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(features), target)
        loss.backward()
        optimizer.step()
    state = {"model": dict(model.state_dict())}
    opt = optimizer.state_dict()["state"]
    state["optimizer"] = {str(k): {n: v for n, v in s.items()} for k, s in opt.items()}
    state["metrics"] = {"loss_sum": loss.detach().double().reshape(()), "samples": torch.tensor(c["updates"] * c["batch"])}
    return state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="alpha-run", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="job config (TOML); default: the values of configs/demo.toml")
    parser.add_argument("--store", default="./alpha-store", help="store directory (default ./alpha-store)")
    parser.add_argument("--run", help="run name (overrides the config)")
    args = parser.parse_args(argv)
    c = load_config(args.config)
    if args.run:
        c["run"] = args.run
    args.run, args.step = c["run"], c["step"]
    state = demo_state(c)
    root = save(state, store=args.store, run=c["run"], step=c["step"], update=c["updates"],
                cursor=c["updates"] * c["batch"], epoch=0, metadata={"job": "demo", "config": c})
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
