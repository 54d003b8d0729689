"""state_digest: the BLAKE3 of the logical learner state, independent of placement.

Covers every tensor of the state (parameters, optimizer state, running
metrics) in sorted name order, each as name, dtype, shape and little-endian
bytes, then the committed update and the input cursor. The membership epoch is
deliberately excluded: a continuation changes it without changing the state.
"""
from __future__ import annotations

import blake3

from alpha_ckpt.format.records import canonical_json
from alpha_ckpt.state.manifest import dtype_name
from alpha_ckpt.state.capture import flatten_state
from alpha_ckpt.generation.writer import word_bytes


def state_digest(tensors: dict, update: int, cursor: int) -> str:
    h = blake3.blake3()
    for name, t in sorted(flatten_state(tensors)):
        h.update(canonical_json({"name": name, "dtype": dtype_name(t.dtype, name), "shape": list(t.shape)}))
        h.update(memoryview(word_bytes(t).numpy()) if t.numel() else b"")
    h.update(canonical_json({"update": update, "cursor": cursor}))
    return h.hexdigest()
