"""The recovery benchmark's timing, from the training script's logs (pure: no processes, no clocks).

Each rank of each attempt appends JSON lines ``{"event", "attempt", "t", ...}`` to ``rank<R>.jsonl``
(bench/recovery_train.py); the rank that kills itself writes ``kill.json`` (``{"t", "rank",
"step"}``) first. :func:`recovery_of` turns them into the recovery time and its parts.
"""
from __future__ import annotations

import json
import os

RECOVERY_METHODS = ("torchrun-dcp", "alpha-run", "alpha-run-memory", "alpha-run-memory-inplace",
                    "alpha-run-memory-spares")
BASELINE = "torchrun-dcp"
# The restarted attempt's milestones, in order: each part is the slowest rank's milestone minus the
# slowest rank's previous one (the kill, for the first), so the parts add up to the recovery time.
MILESTONES = ("started", "imported", "joined", "built", "restored", "step")
PARTS = ("relaunch", "import", "rendezvous", "build", "restore", "first_step")


def read_logs(directory: str) -> dict:
    """``{"kill": {...} or None, "ranks": {rank: [event, ...]}}`` from a run's log directory; a line
    cut short by the kill (the last of its file) is dropped."""
    logs: dict = {"kill": None, "ranks": {}}
    kill = os.path.join(directory, "kill.json")
    if os.path.exists(kill):
        with open(kill) as f:
            text = f.read()
        logs["kill"] = json.loads(text) if text.strip() else None
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                logs["ranks"][int(name[4:-6])] = parse_lines(f.read())
    return logs


def parse_lines(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line a SIGKILL cut short
    return events


def recovery_of(logs: dict, ranks: int, kill_after: int) -> dict:
    """The recovery of one run: ``recovery_s`` (the slowest rank's first completed step in the
    restarted attempt minus the kill time), ``parts_s`` (see PARTS), ``restored`` (what rank 0's
    restore read), ``first_losses`` (each rank's loss of that step); ``error`` says what is missing."""
    kill = logs.get("kill")
    if not kill:
        return {"error": "no rank wrote its kill time"}
    if sorted(logs["ranks"]) != list(range(ranks)):
        return {"error": f"logs of ranks {sorted(logs['ranks'])}, expected {ranks}"}
    firsts: dict[str, list[float]] = {m: [] for m in MILESTONES}
    restored, losses = {}, []
    for rank in range(ranks):
        after = [e for e in logs["ranks"][rank] if e.get("attempt", 0) >= 1]
        if not after:
            return {"error": f"rank {rank} never restarted"}
        attempt = min(e["attempt"] for e in after)
        events = [e for e in after if e["attempt"] == attempt]
        for milestone in MILESTONES:
            hit = next((e for e in events if e["event"] == milestone), None)
            if hit is None:
                return {"error": f"rank {rank} logged no {milestone!r} after the restart"}
            firsts[milestone].append(hit["t"])
        back = next(e for e in events if e["event"] == "restored")
        if back.get("step") != kill_after:
            return {"error": f"rank {rank} resumed at step {back.get('step')}, not {kill_after}"}
        if rank == 0:
            restored = {k: v for k, v in back.items() if k not in ("event", "attempt", "t")}
        losses.append(next(e for e in events if e["event"] == "step").get("loss"))
    parts, previous = {}, kill["t"]
    for part, milestone in zip(PARTS, MILESTONES):
        slowest = max(firsts[milestone])
        parts[part] = slowest - previous
        previous = slowest
    return {"recovery_s": max(firsts["step"]) - kill["t"], "parts_s": parts, "restored": restored,
            "first_losses": losses}
