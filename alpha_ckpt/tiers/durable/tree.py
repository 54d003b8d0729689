"""Manifest-tree publication on a bounded-fan-out hierarchy.

Every owner (its role is its rank) takes part at the same update boundary:

1. it writes its own shards durably (its share of the words; which replicated words each role
   writes is the caller's choice);
2. it receives one commitment from each child the hierarchy prescribes,
   waiting at most ``timeout`` seconds, and checks each: the same capture
   prefix as its own, exactly the prescribed role and subtree size, and the
   same digest of the replicated state (diverged replicas publish nothing);
3. it writes its group manifest (the prefix, a record per own shard, one
   record per child: role, subtree size, digest and size of the child's group
   manifest) and sends its parent only a commitment: the prefix plus that one
   record;
4. the root publishes the ref naming its group manifest; then the completion
   is released down the tree. No owner reports the update committed before
   it arrives.

Any failure (a missing or refused commitment, a failed write) becomes an
abort that travels up to the root, and then, as a failed completion, down to
every owner that can still hear. Messages are fixed-size canonical JSON (no
pickle), point to point between parent and child only. No owner holds another
owner's tensor bytes; an owner holds at most fanout + 1 messages and its own
group manifest.

The same code runs over a process group (:class:`GroupTransport`) and, to
simulate large hierarchies in one process, over :class:`MemoryTransport`.
"""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import blake3
import torch
import torch.distributed as dist

from alpha_ckpt.runtime import hooks
from alpha_ckpt.runtime.hooks import fault_point
from alpha_ckpt.errors import DurableWriteError, PublishConflict, Refusal, RefusalCode
from alpha_ckpt.format.records import CapturePrefix, ChildRef, ManifestHead, Publisher, RegionDecl, canonical_json
from alpha_ckpt.state.manifest import check_root_manifest
from alpha_ckpt.generation.planner import Hierarchy, Piece
from alpha_ckpt.store import Store
from alpha_ckpt.generation.writer import ShardCarry, write_manifest, write_shards
from alpha_ckpt.tiers.durable.messages import Completion, WriteReport, Outcome, written_verdict
from alpha_ckpt.tiers.durable.publisher import Contribution, shard_lists
from alpha_ckpt.tiers.durable.wire import broadcast_json, gather_json, global_rank, message_tensor

MESSAGE_BYTES = 1024  # every message: canonical JSON padded with spaces


def encode_message(obj: Any) -> bytes:
    data = canonical_json(obj)
    if len(data) > MESSAGE_BYTES:
        raise ValueError(f"message of {len(data)} bytes exceeds {MESSAGE_BYTES}")
    return data + b" " * (MESSAGE_BYTES - len(data))


def decode_message(data: bytes, what: str) -> dict:
    try:
        obj = json.loads(bytes(data).decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise Refusal(RefusalCode.FORMAT, f"{what} is not a JSON message") from None
    if not isinstance(obj, dict) or obj.get("kind") not in ("commit", "abort", "complete"):
        raise Refusal(RefusalCode.FORMAT, f"{what} is not a commitment, abort or completion")
    return obj


@dataclass(frozen=True)
class Commitment:
    """What a child sends its parent: its capture prefix and the record of its group manifest."""

    prefix: CapturePrefix
    record: ChildRef
    replicas: str       # BLAKE3 of the replicated words this owner holds
    subtree_bytes: int  # bytes of every object published by the subtree (for the ref)

    def to_json(self) -> dict:
        return {"kind": "commit", "prefix": self.prefix.to_json(), "record": self.record.to_json(),
                "replicas": self.replicas, "subtree_bytes": self.subtree_bytes}

    @classmethod
    def from_json(cls, obj: dict, what: str) -> "Commitment":
        try:
            r = obj["record"]
            record = ChildRef(int(r["role"]), int(r["size"]), str(r["digest"]), int(r["bytes"]))
            return cls(CapturePrefix.from_json(obj["prefix"], what), record, str(obj["replicas"]),
                       int(obj["subtree_bytes"]))
        except (KeyError, TypeError, ValueError):
            raise Refusal(RefusalCode.FORMAT, f"{what} is not a well-formed commitment") from None


def check_commitment(commitment: Commitment, *, role: int, size: int, prefix: CapturePrefix, replicas: str) -> ChildRef:
    """The parent's checks of child ``role``'s commitment (pure). Complete coverage follows by induction."""
    claimed = commitment.record
    if commitment.prefix != prefix:
        raise Refusal(RefusalCode.MIXED_CAPTURE, f"the commitment for role {role} captured {commitment.prefix}, "
                      f"its parent captured {prefix}")
    if claimed.role != role:
        raise Refusal(RefusalCode.COVERAGE, f"a commitment claims role {claimed.role} where the hierarchy "
                      f"prescribes role {role}")
    if claimed.size != size:
        raise Refusal(RefusalCode.COVERAGE, f"role {role} claims a subtree of {claimed.size} roles; the hierarchy "
                      f"prescribes {size}")
    if commitment.replicas != replicas:
        raise Refusal(RefusalCode.MIXED_CAPTURE, f"role {role}'s replicated state differs from its parent's")
    return claimed


# ---------------------------------------------------------------- transports


class Transport(Protocol):
    def send(self, dst: int, message: bytes) -> None:
        """Deliver one message to ``dst``; ConnectionError when ``dst`` is gone."""

    def receive(self, waits: Mapping[int, float]) -> dict[int, bytes]:
        """One message from each source in ``waits`` that arrives within its seconds (the rest are absent)."""


class GroupTransport:
    """Messages over a torch.distributed process group, as uint8 tensors of MESSAGE_BYTES.

    NCCL jobs pass a gloo group for these control messages: it moves host
    memory. A receive is waited for on a helper thread, never with gloo's own
    timeout: a gloo timeout closes every connection of the group, after which
    this owner could not even pass on the abort.
    """

    def __init__(self, group: Any = None):
        self.group = group

    def _peer(self, role: int) -> int:
        """A role is a rank of the group; torch addresses peers by global rank."""
        return role if self.group is None else dist.get_global_rank(self.group, role)

    def send(self, dst: int, message: bytes) -> None:
        try:
            dist.send(message_tensor(message), self._peer(dst), group=self.group)
        except (RuntimeError, ConnectionError) as exc:  # DistBackendError is a RuntimeError
            raise ConnectionError(f"owner {dst} cannot be reached: {exc}") from None

    def receive(self, waits: Mapping[int, float]) -> dict[int, bytes]:
        # Post every receive first so that no child's send waits on another child.
        posted = []
        for src in waits:
            buf = torch.empty(MESSAGE_BYTES, dtype=torch.uint8)
            work = dist.irecv(buf, self._peer(src), group=self.group)
            outcome: dict[str, bool] = {}
            settled = threading.Event()
            threading.Thread(target=_settle, args=(work, outcome, settled), daemon=True,
                             name=f"alpha-ckpt-recv-{src}").start()
            posted.append((src, buf, outcome, settled))
        start = time.monotonic()
        out = {}
        for src, buf, outcome, settled in posted:
            # A dead peer settles at once (connection closed); a silent one runs out its time.
            if settled.wait(max(0.0, start + waits[src] - time.monotonic())) and outcome.get("ok"):
                out[src] = buf.numpy().tobytes()
        return out


def _settle(work: Any, outcome: dict, settled: threading.Event) -> None:
    try:
        work.wait()
        outcome["ok"] = True
    except RuntimeError:
        outcome["ok"] = False
    finally:
        settled.set()


class MemoryTransport:
    """In-process mailboxes between roles, for simulating hierarchies of any size in one process."""

    def __init__(self):
        self._boxes: dict[tuple[int, int], deque] = {}
        self.gone: set[int] = set()

    def endpoint(self, role: int) -> "_MemoryEndpoint":
        return _MemoryEndpoint(self, role)


class _MemoryEndpoint:
    def __init__(self, net: MemoryTransport, role: int):
        self.net, self.role = net, role

    def send(self, dst: int, message: bytes) -> None:
        if dst in self.net.gone:
            raise ConnectionError(f"role {dst} is gone")
        self.net._boxes.setdefault((self.role, dst), deque()).append(bytes(message))

    def receive(self, waits: Mapping[int, float]) -> dict[int, bytes]:
        out = {}
        for src in waits:
            box = self.net._boxes.get((src, self.role))
            if box:
                out[src] = box.popleft()
                if not box:
                    del self.net._boxes[(src, self.role)]
        return out


# ---------------------------------------------------------------- one role


def write_or_fail(store: Store, prefix: CapturePrefix, regions: Sequence[RegionDecl],
                  shards: Sequence[Sequence[tuple[Piece, memoryview, str]]], who: str, *,
                  pool: ThreadPoolExecutor | None = None, carry: ShardCarry | None = None,
                  digests_out: dict | None = None, writers: int = 1,
                  agreed_mode: str | None = None) -> tuple[list, tuple[str, str | None] | None]:
    """Write ``who``'s own shards: (shard records, None), or ([], (reason, refusal code or None)) when a
    write failed or refused (a NaN), so that the failure can travel to every owner. ``writers``: how
    many owners write at once, ``agreed_mode`` the save's (both as :func:`alpha_ckpt.generation.writer.write_shards`)."""
    try:
        return write_shards(store, prefix, regions, shards, pool, carry=carry, digests_out=digests_out,
                            writers=writers, agreed_mode=agreed_mode), None
    except (OSError, DurableWriteError) as exc:
        return [], (f"{who} could not write its shards: {exc}", None)
    except Refusal as refusal:
        return [], (f"{who}: {refusal.message}", refusal.code.value)


def take_lease(store: Store, prefix: CapturePrefix, who: str) -> tuple[Any, tuple[str, None] | None]:
    """The pending-publish lease of ``who``'s writes: (lease, None), or (None, (reason, None)) when the store
    cannot keep one (a full file system), so that the failure travels to every owner as a failed write does
    instead of leaving the others waiting for this one."""
    try:
        return store.pending_publish(prefix.run, prefix.step), None
    except (OSError, DurableWriteError) as exc:
        return None, (f"{who} could not take its pending-publish lease: {exc}", None)


def _failed(reason: str, code: str | None = None) -> dict:
    """A failed completion (its reason cut to fit one message); ``code`` when it is a refusal."""
    return {"kind": "complete", "ok": False, "reason": reason[:600], **({"code": code} if code else {})}


@dataclass
class RoleStats:
    """What one role did in one publication (the simulation reports the largest per level)."""

    messages_sent: int = 0
    messages_received: int = 0
    bytes_held: int = 0  # received messages plus its own group manifest, at most


class TreeRole:
    """Role ``role`` of a publication over ``hierarchy``: :meth:`commit`, then :meth:`complete`.

    Real owners call both in turn. The simulation calls :meth:`commit` for
    every role in reverse preorder (children before parents), then
    :meth:`complete` in preorder.
    """

    def __init__(self, store: Store, hierarchy: Hierarchy, role: int, transport: Transport, *,
                 timeout: float, pool: ThreadPoolExecutor | None = None, carry: ShardCarry | None = None,
                 check_root: Callable[[ManifestHead], None] | None = None):
        self.store, self.hierarchy, self.role, self.transport = store, hierarchy, role, transport
        # The root's manifest, decoded as a reader decodes it, must pass the one validator before the ref:
        # check_root_manifest (the tree's coverage is structural, its words checked where they were agreed).
        self.check_root = check_root or (lambda m: check_root_manifest(m, None, f"root manifest {m.digest[:16]}..."))
        self.timeout, self.pool, self.carry = timeout, pool, carry
        path = hierarchy.path(role)
        self.size = path[-1][1]
        self.parent = path[-2][0] if len(path) > 1 else None
        self.children = hierarchy.children(role, self.size)
        self.stats = RoleStats()
        self._lease = None  # the pending-publish lease, held from commit() (or write_own()) to complete()
        self._written: list | None = None  # this role's shard records, once written
        self._write_failure: tuple[str, str | None] | None = None

    def _send(self, dst: int, obj: dict) -> None:
        self.stats.messages_sent += 1
        self.transport.send(dst, encode_message(obj))

    def commit(self, prefix: CapturePrefix, regions: Sequence[RegionDecl],
               own_shards: Sequence[Sequence[tuple[Piece, memoryview, str]]], replicas: str,
               metadata: Any, follows: int | None = None, state: Any = None) -> dict | None:
        """Steps 1-3 (and the ref, at the root). Returns the completion to release at the root, else None.

        Holds a pending-publish lease from before the first own object until :meth:`complete`: until
        the root's ref names them, gc must spare them. A refusal anywhere (a NaN in a role's words, a
        fenced history at the root) travels with its code, so every owner raises that refusal.
        ``follows`` (the root's): see :func:`alpha_ckpt.store.check_fence`. ``state``: the typed
        skeleton, recorded by the root manifest only. After :meth:`write_own`, ``own_shards`` is
        not used (pass None).
        """
        if self._written is None:
            self.write_own(prefix, regions, own_shards)
        try:
            return self._commit(prefix, regions, replicas, metadata, follows, state)
        except BaseException:
            self.release()
            raise

    def write_own(self, prefix: CapturePrefix, regions: Sequence[RegionDecl],
                  own_shards: Sequence[Sequence[tuple[Piece, memoryview, str]]],
                  digests_out: dict | None = None, agreed_mode: str | None = None) -> tuple[str, str | None] | None:
        """Step 1 alone: take the lease and write this role's shards; the failure (reason, refusal code) or None.

        A caller that must check something between the shards and the manifests (the
        Checkpointer compares replica digests the writes computed) calls this, then
        :meth:`commit` (which then writes nothing), or :meth:`release` to give up.
        """
        self._lease, failure = take_lease(self.store, prefix, f"role {self.role}")
        if failure is not None:
            self._written, self._write_failure = [], failure
            return failure
        try:
            self._written, self._write_failure = write_or_fail(self.store, prefix, regions, own_shards,
                                                               f"role {self.role}", pool=self.pool, carry=self.carry,
                                                               digests_out=digests_out, writers=self.hierarchy.owners,
                                                               agreed_mode=agreed_mode)
        except BaseException:
            self.release()
            raise
        return self._write_failure

    def release(self) -> None:
        """Give back the pending-publish lease (idempotent); the role may then commit a next publication."""
        self._written, self._write_failure = None, None
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _commit(self, prefix: CapturePrefix, regions: Sequence[RegionDecl], replicas: str,
                metadata: Any, follows: int | None, state: Any = None) -> dict | None:
        # the first failure, and its refusal code when it is a refusal
        failure, code = self._write_failure if self._write_failure is not None else (None, None)
        shard_refs = self._written
        # Always hear every child out, so none is left blocked in its send. A child
        # reports its own subtree's failure only after its own waits: allow it
        # one timeout per level below it, so the first failure's reason arrives.
        arrived = self.transport.receive({c: self.timeout * (self.hierarchy.height(n) + 1) for c, n in self.children})
        self.stats.messages_received += len(arrived)
        self.stats.bytes_held = sum(len(m) for m in arrived.values())
        records, subtree_bytes = [], sum(s.size for s in shard_refs)
        for child, size in self.children:
            if child not in arrived:
                waited = self.timeout * (self.hierarchy.height(size) + 1)
                failure = failure or (f"the subtree of role {child} ({size} roles) sent no commitment within "
                                      f"{waited:g} s")
                continue
            try:
                message = decode_message(arrived[child], f"the message from role {child}")
                if message["kind"] == "abort":
                    if failure is None:
                        failure, code = str(message.get("reason")), message.get("code")
                    continue
                commitment = Commitment.from_json(message, f"the commitment from role {child}")
                records.append(check_commitment(commitment, role=child, size=size, prefix=prefix, replicas=replicas))
                subtree_bytes += commitment.subtree_bytes
            except Refusal as refusal:
                failure = failure or f"role {self.role} refused a commitment: [{refusal.code.value}] {refusal.message}"
        if failure is None:
            try:
                digest, nbytes = write_manifest(
                    self.store, prefix, regions, shard_refs, self.hierarchy.owners, metadata,
                    Publisher("tree", self.hierarchy.fanout, self.role, self.size), records,
                    state if self.parent is None else None, check=self.check_root if self.parent is None else None)
                self.stats.bytes_held += nbytes
                subtree_bytes += nbytes
            except Refusal as refusal:
                failure, code = refusal.message, refusal.code.value
            except (OSError, DurableWriteError, ValueError) as exc:
                failure = f"role {self.role} could not write its group manifest: {exc}"
        if self.parent is None:
            if failure is not None:
                return _failed(failure, code)
            try:
                ref = self.store.publish_ref(prefix, digest, nbytes, subtree_bytes, owners=self.hierarchy.owners,
                                             follows=follows)
            except Refusal as refusal:
                return _failed(refusal.message, refusal.code.value)
            except (OSError, DurableWriteError, PublishConflict) as exc:
                return _failed(f"the root could not publish the ref: {exc}")
            # The generation number travels with the completion: no owner re-reads the ref to learn it.
            return {"kind": "complete", "ok": True, "root": digest, "generation": ref.generation, "bytes": ref.bytes}
        if failure is not None:
            self._send_up({"kind": "abort", "role": self.role, "reason": failure[:600],
                           **({"code": code} if code else {})})
            return None
        commitment = Commitment(prefix, ChildRef(self.role, self.size, digest, nbytes), replicas, subtree_bytes)
        self._send_up(commitment.to_json())
        return None

    def _send_up(self, obj: dict) -> None:
        obj = hooks.installed().tamper(self.role, obj)  # the default hooks send it as it is
        if obj is None:
            return
        try:
            self._send(self.parent, obj)
        except ConnectionError:
            pass  # the parent is gone: no completion will come, and complete() says so

    def complete(self, at_root: dict | None = None) -> dict:
        """Step 4: the completion from the parent (or, at the root, ``at_root``), passed on to every child."""
        try:
            return self._complete(at_root)
        finally:
            self.release()

    def _complete(self, at_root: dict | None) -> dict:
        if self.parent is None:
            completion = at_root
        else:
            # The parent answers after its own slowest child: allow one timeout per level, plus one.
            wait = self.timeout * (self.hierarchy.height() + 2)
            arrived = self.transport.receive({self.parent: wait})
            self.stats.messages_received += len(arrived)
            if self.parent in arrived:
                try:
                    completion = decode_message(arrived[self.parent], f"the completion from role {self.parent}")
                except Refusal as refusal:
                    completion = {"kind": "complete", "ok": False, "reason": refusal.message}
            else:
                completion = {"kind": "complete", "ok": False,
                              "reason": f"no completion from parent role {self.parent} within {wait:g} s"}
        fault_point("publish", "before-completion")
        for child, _ in self.children:
            try:
                self._send(child, completion)
            except ConnectionError:
                pass  # a dead child hears nothing; the launcher stops it
        return completion


# ---------------------------------------------------------------- the publisher


class TreePublisher:
    """The tree behind the publisher interface (:class:`~alpha_ckpt.tiers.durable.publisher.Publisher`): every
    rank writes its own shards; the ranks agree that the writes succeeded and the replicas match (rank 0
    hears every rank's :class:`~alpha_ckpt.tiers.durable.messages.WriteReport` and broadcasts one verdict);
    then group manifests and commitments go up, the completion down."""

    def __init__(self, store: Store, hierarchy: Hierarchy, rank: int, *, device: Any, timeout: float,
                 carry: ShardCarry | None = None, identity: Any = None):
        self.store, self.hierarchy, self.rank, self.device = store, hierarchy, rank, device
        self.timeout, self.carry, self.identity = timeout, carry, identity
        self.phases: dict[str, float] = {}  # the last publish's seconds: write (this role's shards), commit (the rest)

    def publish(self, c: Contribution) -> Completion:
        started = time.perf_counter()
        try:
            return self._publish(c, started)
        finally:
            self.phases.setdefault("write", time.perf_counter() - started)
            self.phases["commit"] = time.perf_counter() - started - self.phases["write"]

    def _publish(self, c: Contribution, started: float) -> Completion:
        self.phases = {}
        metadata = dict(c.metadata) if self.rank == 0 else {"device": self.device}
        role = TreeRole(self.store, self.hierarchy, self.rank, GroupTransport(c.group), timeout=self.timeout,
                        carry=self.carry,
                        check_root=lambda m: check_root_manifest(m, None, f"root manifest {m.digest[:16]}...",
                                                                 identity=self.identity, metadata=metadata))
        written: dict[tuple, str] = {}
        root0 = global_rank(0, c.group)
        try:
            failure = role.write_own(c.prefix, c.regions, shard_lists(c.parts), digests_out=written,
                                     agreed_mode=c.layout.write_mode)
            self.phases["write"] = time.perf_counter() - started
            report = WriteReport(replicas=c.replica_digests(written), shared=c.shared_digests(written),
                                 failure=list(failure) if failure else None)
            reports = gather_json(report.to_json(), root0, c.group)
            verdict = written_verdict([WriteReport.from_json(r) for r in reports]) if self.rank == 0 else None
            verdict = Outcome.from_json(broadcast_json(verdict.to_json() if verdict else None, root0, c.group))
        except BaseException:
            role.release()
            raise
        if not verdict.ok:
            role.release()
            return Completion.failed(verdict)
        # The commitments carry the agreed layout's digest (the replicas were compared just above).
        agreed = blake3.blake3(canonical_json([c.layout.state, c.layout.regions])).hexdigest()
        return Completion.of_tree(role.complete(role.commit(c.prefix, c.regions, None, agreed, metadata,
                                                            follows=c.follows, state=c.layout.state)))
