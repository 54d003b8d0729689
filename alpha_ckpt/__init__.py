"""alpha_ckpt: checkpoints that are one consistent state of one learner, or nothing.

The one-process API (the launcher makes it collective)::

    state = {"model": model, "optim": optimizer, "sched": scheduler, "rng": alpha_ckpt.RNGState(), "step": step}
    root = alpha_ckpt.save(state, store="ckpt", run="nightly", step="fit", update=3, cursor=96, epoch=0)
    counters = alpha_ckpt.restore(state, store="ckpt", root=root)   # in place, or Refusal

A state holds tensors, NumPy arrays, Stateful objects (``state_dict()`` /
``load_state_dict()``), None, bool, int, float, str, bytes, and lists,
tuples and dicts of them; see :mod:`alpha_ckpt.state`.

Asynchronous (training goes on while the generation is written)::

    saver = alpha_ckpt.AsyncSaver()
    handle = alpha_ckpt.save_async(state_dict, store=store, run="nightly", step="fit", update=3, cursor=96,
                                   epoch=0, saver=saver)
    root = handle.result().root   # durable once this returns
"""
from __future__ import annotations

import importlib

# Importing the package starts no thread and installs no signal handler: alpha-run's processes
# bind their lives to the launcher themselves (alpha_ckpt/launch/script_runner.py, alpha_ckpt/job/__main__.py).
from alpha_ckpt.errors import (CollectiveIncomplete, DurableWriteError, PublishConflict, Refusal, RefusalCode,  # torch-free
                     RestoreIncomplete, UsageError, WorkerRNGWarning)

__version__ = "0.1.0"

# Everything else is imported on first use (PEP 562), so that what needs no torch (alpha-run's
# checks of its flags, config and store; the store and format layers) starts in a fraction of
# a second instead of the seconds torch takes to import.
_LAZY = {
    "save": "api", "save_async": "api", "restore": "api", "verify": "api", "latest": "api", "Latest": "api",
    "Skipped": "api", "AsyncSaver": "generation.async_save", "SaveHandle": "generation.async_save", "ShardCarry": "generation.writer",
    "Published": "generation.writer", "RNGState": "state", "WorkerRNGDataset": "state.loaders", "CapturedState": "state",
    "capture_state": "state",
    "PerRank": "state.placement", "Partitioned": "state.placement", "Store": "store", "Counters": "generation.reader",
    "CapturePrefix": "format.records", "Checkpointer": "collective", "CheckpointerOptions": "collective",
    "SaveResult": "collective", "run_resilient": "launch.resilient",
}
__all__ = ["save", "save_async", "AsyncSaver", "SaveHandle", "ShardCarry", "restore", "verify", "latest", "Latest",
           "Skipped", "RNGState", "WorkerRNGDataset", "Checkpointer", "CheckpointerOptions", "SaveResult", "PerRank",
           "Partitioned", "Store", "Refusal", "RefusalCode", "Counters", "DurableWriteError", "PublishConflict",
           "UsageError", "WorkerRNGWarning", "RestoreIncomplete", "CollectiveIncomplete", "run_resilient"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'alpha_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
