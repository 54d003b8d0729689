"""The star publisher: rank 0 hears every rank itself and writes one root manifest naming every shard.

Every rank writes its own shards durably (no rank sends another its tensor
bytes); then rank 0 gathers every rank's shard records, replica digests and
write outcome (one :class:`~alpha_ckpt.tiers.durable.messages.WriteReport` each),
compares the digests, writes the root manifest and the ref durably, and
broadcasts the :class:`~alpha_ckpt.tiers.durable.messages.Completion`. The tree
(:mod:`alpha_ckpt.tiers.durable.tree`) differs in its levels: every parent hears at
most ``fanout`` children.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from alpha_ckpt.errors import DurableWriteError, PublishConflict, Refusal
from alpha_ckpt.format.records import ShardRef
from alpha_ckpt.runtime.hooks import fault_point
from alpha_ckpt.state.manifest import check_root_manifest
from alpha_ckpt.store import Store
from alpha_ckpt.generation.writer import ShardCarry, write_manifest
from alpha_ckpt.tiers.durable.messages import Completion, Outcome, WriteReport, written_verdict
from alpha_ckpt.tiers.durable.publisher import Contribution, shard_lists
from alpha_ckpt.tiers.durable.tree import take_lease, write_or_fail
from alpha_ckpt.tiers.durable.wire import broadcast_json, gather_json, global_rank

logger = logging.getLogger("alpha_ckpt")


class StarPublisher:
    """Rank ``rank`` of ``world`` publishing into ``store`` (see the module docstring)."""

    def __init__(self, store: Store, rank: int, world: int, *, carry: ShardCarry | None = None,
                 identity: Any = None, publish_ref: bool = True):
        """``publish_ref=False``: the root manifest is written but no ref (the memory tier writes its refs once
        the copies stand); rank 0 then keeps, per root, the shards it names in :attr:`named` until taken."""
        self.store, self.rank, self.world, self.carry, self.identity = store, rank, world, carry, identity
        self.publish_ref = publish_ref
        self.named: dict[str, list] = {}
        self.phases: dict[str, float] = {}  # the last publish's seconds: write (this rank's shards), commit (the rest)

    def publish(self, c: Contribution) -> Completion:
        root0 = global_rank(0, c.group)
        written: dict[tuple, str] = {}
        started = time.perf_counter()
        # gc spares what this rank writes until the ref names it, or the publish has failed
        lease, failure = take_lease(self.store, c.prefix, f"rank {self.rank}")
        try:
            shard_refs = []
            if failure is None:
                shard_refs, failure = write_or_fail(self.store, c.prefix, c.regions, shard_lists(c.parts),
                                                    f"rank {self.rank}", carry=self.carry, digests_out=written,
                                                    writers=self.world, agreed_mode=c.layout.write_mode)
            wrote = time.perf_counter()
            report = WriteReport(replicas=c.replica_digests(written), shared=c.shared_digests(written),
                                 shards=[s.to_json() for s in shard_refs],
                                 failure=list(failure) if failure else None)
            reports = gather_json(report.to_json(), root0, c.group)
            if self.rank != 0:
                ack = Completion.from_json(broadcast_json(None, root0, c.group))
            else:
                reports = [WriteReport.from_json(r) for r in reports]
                verdict = written_verdict(reports)
                ack = Completion.failed(verdict)
                if verdict.ok:
                    ack = self._publish_root(c, once([ShardRef.from_json(s) for r in reports for s in r.shards]))
            fault_point("publish", "before-completion")
            if self.rank == 0:
                broadcast_json(ack.to_json(), root0, c.group, echo=False)
            self.phases = {"write": wrote - started, "commit": time.perf_counter() - wrote}
            return ack
        finally:
            if lease is not None:
                lease.release()

    def _publish_root(self, c: Contribution, shard_refs: list[ShardRef]) -> Completion:
        """Rank 0: the root manifest naming every rank's shards, then the ref; the acknowledgment."""
        try:
            root, size = write_manifest(self.store, c.prefix, c.regions, shard_refs, self.world, dict(c.metadata),
                                        state=c.layout.state,
                                        check=lambda m: check_root_manifest(m, shard_refs, f"root manifest "
                                                                            f"{m.digest[:16]}...",
                                                                            identity=self.identity,
                                                                            metadata=dict(c.metadata)))
            if not self.publish_ref:
                self.named[root] = [[s.digest, s.size] for s in shard_refs]
                return Completion(Outcome.success(), root, 0, size)  # generation 0: no ref; bytes: the root's size
            record = self.store.publish_ref(c.prefix, root, size, size + sum(s.size for s in shard_refs),
                                            owners=self.world, follows=c.follows)
            return Completion(Outcome.success(), root, record.generation, record.bytes)
        except Refusal as refusal:
            return Completion.failed(Outcome.of(refusal))
        except (OSError, ValueError, PublishConflict, DurableWriteError) as exc:
            return Completion.failed(Outcome(False, str(exc)))
        except Exception as exc:  # noqa: BLE001 - any failure here: every rank must hear it, not wait out the group
            logger.exception("rank 0: publishing the root of update %d failed", c.prefix.update)
            return Completion.failed(Outcome(False, f"{type(exc).__name__}: {exc}"))


def once(shards: list[ShardRef]) -> list[ShardRef]:
    """Each shard object once, in order. Ranks can write byte-identical shards (each holding only
    an empty piece of the same regions: a [1, k] Shard(0) parameter on 3 ranks), and a manifest
    that named one object twice would be refused by every reader."""
    return list({s.digest: s for s in shards}.values())
