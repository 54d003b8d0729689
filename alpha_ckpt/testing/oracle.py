"""The oracle: the distributed learner's exact arithmetic, run in one process.

    python -m alpha_ckpt.testing.oracle CONFIG --updates N [--placements 4:3,3:2] [--set KEY=VALUE ...]

``--device cuda`` runs on the GPU, to compare with NCCL jobs (their kernels
differ from the CPU's, so their bits do too). ``--placements 4:3,3:2`` means 4 owners for 3 updates, then 3 owners for 2
(the last segment is extended or cut to reach ``--updates``; default: one
owner throughout). For every update it computes each owner's share gradient
exactly as that owner would, combines the shares in the declared order, and
applies the optimizer. It prints the job's final JSON line; distributed runs
of the same placements must print the same state_digest.
"""
from __future__ import annotations

import argparse
import json
import sys

from alpha_ckpt.job.learner.config import JobConfig, load_config
from alpha_ckpt.job.learner.data import shares
from alpha_ckpt.job.learner.digest import state_digest
from alpha_ckpt.job.learner.model import (
    LearnerState, apply_update, combine, configure_determinism, share_gradient, sum_in_owner_order,
)


def parse_placements(text: str | None, updates: int) -> list[int]:
    """'4:3,3:2' -> owner count for each update 0..updates-1."""
    segments = []
    for part in (text or "1").split(","):
        owners, _, count = part.partition(":")
        try:
            segments.append((int(owners), int(count) if count else None))
        except ValueError:
            raise ValueError(f"--placements {text!r}: expected OWNERS:UPDATES[,OWNERS:UPDATES...]") from None
    per_update: list[int] = []
    for owners, count in segments:
        if owners < 1:
            raise ValueError("a placement needs at least one owner")
        per_update.extend([owners] * (count if count is not None else updates))
    if not per_update:
        raise ValueError("no placements")
    per_update.extend([per_update[-1]] * max(0, updates - len(per_update)))
    return per_update[:updates]


def step(config: JobConfig, state: LearnerState, owners: int) -> None:
    """One update with ``owners`` owners: their shares, combined in owner order."""
    partials, losses = [], []
    for lo, hi in shares(config.batch, owners):
        grads, loss = share_gradient(config, state.params, state.cursor + lo, state.cursor + hi, state.frozen)
        partials.append(grads)
        losses.append(loss)
    apply_update(config, state, combine(partials), sum_in_owner_order(losses))


def run(config: JobConfig, updates: int, placements: list[int], state: LearnerState | None = None,
        device: str = "cpu") -> LearnerState:
    configure_determinism()
    state = state or LearnerState.initial(config, device)
    while state.update < updates:
        step(config, state, placements[state.update])
    return state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m alpha_ckpt.testing.oracle", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--placements")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--device", default="cpu", help="compute device: cpu (gloo jobs) or cuda (NCCL jobs)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
        placements = parse_placements(args.placements, args.updates)
    except ValueError as exc:
        print(f"oracle: {exc}", file=sys.stderr)
        return 2
    state = run(config, args.updates, placements, device=args.device)
    print(json.dumps({"state_digest": state_digest(state.tensors(), state.update, state.cursor), "last_generation": None,
                      "update": state.update, "cursor": state.cursor, "epoch": 0, "owners": placements[-1],
                      "output": None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
