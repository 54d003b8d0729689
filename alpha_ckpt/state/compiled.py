"""A torch.compile'd module's state, keyed as the plain module's.

``torch.compile(module)`` returns an ``OptimizedModule`` holding the module as ``_orig_mod``, so
its ``state_dict()`` keys gain an ``_orig_mod.`` segment (``_orig_mod.head.weight``; a compiled
submodule gives ``blocks.0._orig_mod.qkv.weight``). As torch's ``get_state_dict`` does, that
segment is dropped wherever it names the module an ``OptimizedModule`` wraps, found by walking the
module tree, never by matching text: a plain module's own child called ``_orig_mod`` keeps its
name, so no two keys of one module can come to coincide through it. Compiled and plain modules
then save the same keys and restore into each other.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any, Iterable, Mapping

import torch

WRAPPED = "_orig_mod"


def _optimized_module_type() -> type | None:
    # torch.compile imports it: when it is not imported, no module of this process is compiled
    # (and importing torch._dynamo here would cost a second on every save).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def _plain_key(module: torch.nn.Module, key: str, optimized: type) -> str:
    """``key`` of ``module.state_dict()`` without the segments that name an OptimizedModule's wrapped module."""
    parts, current = [], module
    for part in key.split("."):
        if part == WRAPPED and isinstance(current, optimized):
            current = current._orig_mod
            continue
        parts.append(part)
        # Past a parameter, buffer or extra state the rest of the key is not a module path: kept as it is.
        current = current._modules.get(part) if isinstance(current, torch.nn.Module) else None
    return ".".join(parts)


def plain_keys(module: torch.nn.Module, keys: Iterable[Any]) -> dict[Any, Any] | None:
    """{key as saved: key of ``module.state_dict()``}, in the order of ``keys``; None where every key
    is its own (a module with no compiled part).

    Should dropping the segments make two keys coincide (an OptimizedModule holding state beside
    its wrapped module), None too: the keys are kept as ``state_dict()`` gives them."""
    optimized = _optimized_module_type()
    if optimized is None:
        return None
    out: dict[Any, Any] = {}
    changed = False
    for key in keys:
        plain = _plain_key(module, key, optimized) if isinstance(key, str) and WRAPPED in key else key
        if plain in out:
            return None
        out[plain] = key
        changed = changed or plain != key
    return out if changed else None


def as_plain(module: torch.nn.Module, state: Mapping) -> Mapping:
    """``module.state_dict()`` (``state``) keyed as the plain module's, in its order and dict type."""
    names = plain_keys(module, state.keys())
    if names is None:
        return state
    out = type(state)() if type(state) in (dict, OrderedDict) else {}
    for plain, key in names.items():
        out[plain] = state[key]
    return out
