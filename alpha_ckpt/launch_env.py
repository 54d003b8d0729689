"""alpha-run's protocol with the processes it starts: environment variables, written and read here only.

alpha-run (:mod:`alpha_ckpt.launcher`) hands every rank of a training script
the store, the run, the resume choice and its checkpoint flags in the
environment (torch's elastic agent copies the launcher's environment into
every worker, restarts included), and names itself so that a worker can bind
its life to it (:mod:`alpha_ckpt.lifeline`). This module holds the variable
names, :func:`script_environment` (what the launcher writes),
:func:`launcher_settings` (what :meth:`Checkpointer.from_launcher_env
<alpha_ckpt.Checkpointer.from_launcher_env>` reads) and
:func:`pop_launcher_pid`. No other product module reads or writes them.

Only the standard library and :mod:`alpha_ckpt.errors` are imported here:
the launcher checks its flags before torch is imported.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping

from .errors import UsageError

STORE = "ALPHA_CKPT_STORE"
RUN = "ALPHA_CKPT_RUN"
RESUME = "ALPHA_CKPT_RESUME"
PUBLISHER = "ALPHA_CKPT_PUBLISHER"
FANOUT = "ALPHA_CKPT_FANOUT"
COMMIT_TIMEOUT = "ALPHA_CKPT_COMMIT_TIMEOUT"
SAVE = "ALPHA_CKPT_SAVE"
IN_FLIGHT = "ALPHA_CKPT_IN_FLIGHT"
EVERY = "ALPHA_CKPT_EVERY"
MTBF = "ALPHA_CKPT_MTBF"
CHECKPOINT_COST = "ALPHA_CKPT_CHECKPOINT_COST"
MEMORY = "ALPHA_CKPT_MEMORY"  # the memory tier's directory for this launch (alpha-run --memory), removed at its exit
REPLICAS = "ALPHA_CKPT_REPLICAS"
DURABLE_EVERY = "ALPHA_CKPT_DURABLE_EVERY"
LAUNCHER_PID = "ALPHA_CKPT_LAUNCHER_PID"  # set by alpha-run for every process it starts
# torch's switch for its c10d rendezvous: each round (a restart is one) gives the ranks a store of
# their own instead of the agent's, which outlives attempts and still holds the previous attempt's
# gloo addresses (a restarted rank would connect to a dead peer and wait).
SEPARATE_RANK_STORE = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")


def script_environment(args: Any, run: str) -> dict[str, str]:
    """What alpha-run hands a script's ranks: the store, ``run``, the resume choice, and how to save
    (--publisher, --fanout, --commit-timeout, --save, --in-flight, --checkpoint-every, --mtbf,
    --checkpoint-cost). Neither --resume nor --resume-from: "latest", as under torchrun."""
    env = {STORE: os.path.abspath(args.store), RUN: run, RESUME: args.resume_from or args.resume or "latest",
           PUBLISHER: args.publisher, FANOUT: str(args.fanout), COMMIT_TIMEOUT: str(args.commit_timeout),
           SAVE: args.save, IN_FLIGHT: args.in_flight}
    if str(args.checkpoint_every) != "0":  # the script's ckpt.due(step) follows --checkpoint-every
        env[EVERY] = str(args.checkpoint_every)
        for flag, name in (("mtbf", MTBF), ("checkpoint_cost", CHECKPOINT_COST)):
            if getattr(args, flag):
                env[name] = getattr(args, flag)
    return env


@contextlib.contextmanager
def exported(launcher_pid: int, script: Mapping[str, str] | None = None) -> Iterator[None]:
    """The launcher's environment while it starts its workers: its pid, a store of their own for the
    ranks of each rendezvous round (and a script's settings); what was there before is put back after."""
    values = {LAUNCHER_PID: str(launcher_pid), SEPARATE_RANK_STORE[0]: SEPARATE_RANK_STORE[1], **(script or {})}
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launcher_settings() -> dict[str, Any]:
    """The Checkpointer options alpha-run passed, typed (keyword arguments of
    :class:`~alpha_ckpt.collective.options.CheckpointerOptions`).

    :class:`UsageError` naming what is missing when this process was not started by alpha-run,
    or naming the variable whose value cannot be.
    """
    env = os.environ
    missing = [name for name in (STORE, RUN) if not env.get(name)]
    if missing:
        raise UsageError(f"Checkpointer.from_launcher_env: not started by alpha-run ({' and '.join(missing)} "
                         "unset); pass Checkpointer(store, run=...) instead")
    out: dict[str, Any] = {"store": env[STORE], "run": env[RUN]}
    out["resume"] = env.get(RESUME) or "latest"  # "latest" or a root digest
    for name, key, kind in ((PUBLISHER, "publisher", str), (FANOUT, "fanout", int),
                            (COMMIT_TIMEOUT, "commit_timeout", float), (SAVE, "save", str),
                            (IN_FLIGHT, "in_flight", str)):
        if env.get(name):
            out[key] = _typed(name, env[name], kind)
    if env.get(MEMORY):
        out["memory"] = env[MEMORY]
        for name, key in ((REPLICAS, "replicas"), (DURABLE_EVERY, "durable_every")):
            if env.get(name):
                out[key] = _typed(name, env[name], int)
    if env.get(EVERY):
        out["every"] = "auto" if env[EVERY] == "auto" else _typed(EVERY, env[EVERY], int)
        out["mtbf"] = env.get(MTBF) or None
        out["checkpoint_cost"] = env.get(CHECKPOINT_COST) or None
    return out


def memory_directory() -> str | None:
    """The memory tier's directory alpha-run made for this launch (``--memory``), or None."""
    return os.environ.get(MEMORY) or None


def ranks_per_node() -> int | None:
    """torch's LOCAL_WORLD_SIZE (ranks on this node), as torchrun and alpha-run set it, or None."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def pop_launcher_pid() -> int | None:
    """The launcher's pid, if alpha-run named itself; the name is taken out of the environment so
    that a process this one starts (not the launcher's child) does not bind to it."""
    named = os.environ.pop(LAUNCHER_PID, None)
    try:
        return None if named is None else int(named)
    except ValueError:
        return None


def _typed(name: str, value: str, kind: type) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise UsageError(f"{name}={value!r} is not a {kind.__name__}") from None
