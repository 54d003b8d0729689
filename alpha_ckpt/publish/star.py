"""Star publication: every owner sends its capture to owner 0, which checks and publishes.

Called by every owner at the same update boundary (collective):

1. each owner builds its capture: the capture prefix and the word ranges it
   holds (replicated regions whole, partitioned regions its own range);
2. owners 1..n-1 send theirs to owner 0 (JSON descriptor, then the bytes);
3. owner 0 checks that every prefix equals its own and that every replica of
   replicated state is bit-equal to its own (diverged replicas publish
   nothing), then writes the shards, the manifest and the ref durably;
4. owner 0 broadcasts the durable-completion acknowledgment (the root digest,
   or the reason it failed); no owner reports the update committed before it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..durable import fault_point
from ..errors import PublishConflict, PublishFailed, Refusal, RefusalCode
from ..format import DTYPES, CapturePrefix, RegionDecl, canonical_json
from ..planner import Piece
from ..store import Store
from ..writer import ShardCarry, publish_slices, word_bytes
from .wire import broadcast_json, recv_bytes, send_bytes


@dataclass(frozen=True)
class Capture:
    prefix: CapturePrefix
    pieces: tuple[tuple[int, int, int, bool], ...]  # (ordinal, lo, hi, replicated)
    data: bytes

    def descriptor(self) -> bytes:
        return canonical_json({"prefix": self.prefix.to_json(), "pieces": [list(p) for p in self.pieces],
                               "bytes": len(self.data)})


def build_capture(prefix: CapturePrefix, regions: Sequence[RegionDecl], tensors: Sequence[torch.Tensor],
                  owned: Sequence[tuple[int, int] | None]) -> Capture:
    """A snapshot copy of this owner's words: ``owned[i]`` None means region i is replicated."""
    pieces, chunks = [], []
    for region, tensor, own in zip(regions, tensors, owned):
        lo, hi = own if own is not None else (0, region.words)
        size = DTYPES[region.dtype][0]
        chunks.append(word_bytes(tensor)[lo * size:hi * size].numpy().tobytes())
        pieces.append((region.ordinal, lo, hi, own is None))
    return Capture(prefix, tuple(pieces), b"".join(chunks))


def publish_star(store: Store | None, capture: Capture, regions: Sequence[RegionDecl], metadata: Any,
                 group: Any = None, carry: ShardCarry | None = None, follows: int | None = None,
                 state: Any = None) -> str:
    """Collective over ``group`` (default: the default group). Returns the root digest once owner 0
    reports it durable. Every owner raises owner 0's :class:`Refusal` when the capture is refused
    (a NaN, diverged replicas, a fenced history: exit 3), and PublishFailed for any other failure
    (an I/O error, a lost ref race: retryable). ``follows``: see :func:`alpha_ckpt.store.check_fence`.
    ``state``: the typed skeleton the root manifest records (owner 0's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        send_bytes(capture.descriptor(), 0, group)
        send_bytes(capture.data, 0, group)
        ack = broadcast_json(None, 0, group)
        fault_point("publish", "before-completion")
    else:
        captures = [capture]
        for r in range(1, world):
            descriptor = json.loads(recv_bytes(r, group).decode("ascii"))
            data = recv_bytes(r, group)
            captures.append(Capture(CapturePrefix.from_json(descriptor["prefix"], f"owner {r} capture"),
                                    tuple(tuple(p) for p in descriptor["pieces"]), data))
        try:
            root = _check_and_write(store, captures, regions, metadata, carry, follows, state)
            ack = {"ok": True, "root": root}
        except Refusal as refusal:
            ack = {"ok": False, "code": refusal.code.value, "reason": refusal.message}
        except (OSError, ValueError, PublishConflict) as exc:
            ack = {"ok": False, "reason": str(exc)}
        fault_point("publish", "before-completion")
        broadcast_json(ack, 0, group)
    if not ack["ok"]:
        if ack.get("code"):
            raise Refusal(ack["code"], ack["reason"])
        raise PublishFailed(ack["reason"])
    return ack["root"]


def _views(capture: Capture, regions: Sequence[RegionDecl]):
    offset = 0
    for ordinal, lo, hi, replicated in capture.pieces:
        n = (hi - lo) * DTYPES[regions[ordinal].dtype][0]
        yield (ordinal, lo, hi, replicated), memoryview(capture.data)[offset:offset + n]
        offset += n


def _check_and_write(store: Store, captures: list[Capture], regions: Sequence[RegionDecl], metadata: Any,
                     carry: ShardCarry | None = None, follows: int | None = None, state: Any = None) -> str:
    mine = captures[0]
    replicas = {(o, lo, hi): view for (o, lo, hi, rep), view in _views(mine, regions) if rep}
    shards = []
    for r, capture in enumerate(captures):
        if capture.prefix != mine.prefix:
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"owner {r} captured {capture.prefix}, owner 0 {mine.prefix}")
        parts = []
        for (o, lo, hi, replicated), view in _views(capture, regions):
            if replicated:
                if replicas.get((o, lo, hi)) != view:
                    raise Refusal(RefusalCode.MIXED_CAPTURE,
                                  f"owner {r}'s replica of region {regions[o].name!r} differs from owner 0's")
                if r:
                    continue  # one copy of replicated words: owner 0's
            parts.append((Piece(o, lo, hi, DTYPES[regions[o].dtype][0]), view, "raw"))
        if parts:
            shards.append(parts)
    return publish_slices(store, mine.prefix, regions, shards, metadata=metadata, owners=len(captures),
                          carry=carry, follows=follows, state=state).root
