"""A restore that reads each object from the durable store once per node.

Every rank names the shards its restore opens; rank 0 plans who reads what
(:func:`alpha_ckpt.generation.node_plan.plan_node_reads`) and tells every rank.
An object that one rank of a node alone needs it reads itself, as before. An
object that several ranks of a node need (replicated state) is read by one of
them into a file in the node's shared memory (``/dev/shm``); after a barrier
the others map that file instead of the store. Each rank still checks every
byte it uses (BLAKE3, finiteness) as a restore always does, so a file damaged
in memory is refused like a damaged shard. A file its reader could not make
(the object is missing or of another size in the store) is read from the
store by each rank that needs it, which refuses it as a restore always does.

A node is the ranks of one launcher on one host: the host's name and
torchrun's ``GROUP_RANK`` (two launchers on one machine are two nodes).
The files are removed once every rank opened its objects (after the ranks'
agreement); a reader killed before that leaves a directory named after its
pid, which the next restore on the host removes.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
import tempfile
from typing import Sequence

import torch
import torch.distributed as dist

from alpha_ckpt.errors import Refusal
from alpha_ckpt.format.decoding import parse_shard_header
from alpha_ckpt.format.records import RegionDecl
from alpha_ckpt.generation.node_plan import RankReads, plan_node_reads
from alpha_ckpt.generation.opening import read_head
from alpha_ckpt.generation.payloads import Payloads
from alpha_ckpt.runtime import launch_env
from alpha_ckpt.runtime.orphans import remove_orphaned
from alpha_ckpt.store import ObjectFile, Store
from alpha_ckpt.store.backend import check_opened_size
from alpha_ckpt.format.records import canonical_json
from alpha_ckpt.tiers.durable.wire import broadcast_json, gather_json, global_rank, recv_bytes, send_bytes, wire_device

SHARED_PARENT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "alpha-ckpt-reads-"  # + the reading process's pid + "-" + the restore's token
_COPY_CHUNK = 64 << 20


def node_key() -> str:
    """This rank's node: its host and its launcher's node rank (torchrun's GROUP_RANK; none outside a launcher)."""
    return f"{socket.gethostname()}/{launch_env.node_rank()}"


class NodeReads:
    """This rank's part of a deduplicated restore: :meth:`open_objects` opens what the plan says (the node's
    shared copy, else the store), :meth:`close` removes the files this rank made for its node."""

    def __init__(self, store: Store, plan: RankReads, directories: dict[int, str], rank: int,
                 regions: Sequence[RegionDecl] = ()):
        self.store, self.plan, self.rank = store, plan, rank
        self._directories = dict(directories)  # group rank -> where that rank's shared files are (its node's)
        self.bytes_from_node = 0  # what this rank mapped from a file another rank of its node read
        self._held: list[ObjectFile] = []  # the store's files this rank shares by descriptor, until close()
        self._regions = tuple(regions)  # the generation's: which regions may hold NaN/inf

    @classmethod
    def share(cls, store: Store, objects: Sequence[tuple[str, int]] | None, group=None,
              regions: Sequence[RegionDecl] = ()) -> "NodeReads | None":
        """Collective over ``group``: every rank passes the (name, size) shards it will open, or None (its
        restore refused before knowing them, or it shares none). Returns this rank's part once every rank of
        its node has made the files the plan asks of it; None on every rank when any rank passed None.
        ``regions``: the generation's (the root manifest's), for checking the objects read for the node."""
        rank = dist.get_rank(group)
        root = global_rank(0, group)
        mine = None if objects is None else [[name, size] for name, size in objects]
        said = gather_json({"node": node_key(), "pid": os.getpid(), "objects": mine}, root, group)
        go = said is not None and all(s["objects"] is not None for s in said)
        if not broadcast_json(go if said is not None else None, root, group):
            return None
        # Each rank gets its own part only (its reads, and the directories of its node's readers it maps
        # from): what travels grows with the plan, not with the plan times the ranks.
        if said is not None:
            planned = plan_node_reads([s["node"] for s in said], [s["objects"] for s in said])
            token = secrets.token_hex(6)
            names = {r: f"{PREFIX}{s['pid']}-{token}" for r, (s, p) in enumerate(zip(said, planned)) if p.for_node}
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            for r, p in enumerate(planned):
                part = {"plan": p.to_json(), "directories": {str(reader): names[reader] for reader in
                                                             {*p.from_node.values(), *([r] if p.for_node else [])}}}
                if r == rank:
                    mine_part = part
                else:
                    send_bytes(canonical_json(part), ranks[r], group)
        else:
            mine_part = json.loads(recv_bytes(root, group).decode("ascii"))
        directories: dict[int, str] = {int(r): os.path.join(SHARED_PARENT, d)
                                       for r, d in mine_part["directories"].items()}
        reads = cls(store, RankReads.from_json(mine_part["plan"]), directories, rank, regions)
        try:
            if rank in directories:
                remove_orphaned(SHARED_PARENT, PREFIX)
                reads._read_for_node(directories[rank])
        finally:
            _barrier(group)  # every file of the node made (or given up) before any rank looks for it
        return reads

    def _read_for_node(self, directory: str) -> None:
        """Each object the plan gives this rank, from the store into a file of ``directory``. One that cannot
        be read is left out: each rank that needs it then reads it from the store and refuses it there."""
        try:
            os.mkdir(directory, 0o700)
            opened = self.store.open_objects(self.plan.for_node, "shard")
        except (Refusal, OSError):  # each rank that needs them reads them from the store
            return
        for (name, size), obj in zip(self.plan.for_node, opened):
            path = os.path.join(directory, name)
            try:
                check_opened_size(obj, size, f"shard {name}")
                if obj.fd >= 0:
                    # A file (the store's, in the node's page cache) is shared as it is: checked in place, and
                    # named by a link to this process's descriptor, which stays open until close().
                    _check_object(obj, self._regions)
                    os.symlink(f"/proc/{os.getpid()}/fd/{obj.fd}", path)
                    self._held.append(obj)
                    continue
                _copy_into_file(obj, path, size, self._regions)
            except (Refusal, OSError):  # damaged or missing in the store, or no room in memory: as above
                pass
            obj.close()

    def _path(self, name: str) -> str | None:
        reader = self.rank if any(n == name for n, _ in self.plan.for_node) else self.plan.from_node.get(name)
        directory = None if reader is None else self._directories.get(reader)
        return None if directory is None else os.path.join(directory, name)

    def open_objects(self, wanted: Sequence[tuple[str, int]], what: str) -> list[ObjectFile]:
        """Each (name, size) of ``wanted``: the node's file where the plan made one, else from the store."""
        out: list[ObjectFile | None] = [None] * len(wanted)
        from_store: list[int] = []
        try:
            for i, (name, size) in enumerate(wanted):
                path = self._path(name)
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if path else -1
                except OSError:  # not made, or its reader's descriptor cannot be opened here: from the store
                    fd = -1
                if fd < 0:
                    from_store.append(i)
                    continue
                out[i] = ObjectFile(fd, os.fstat(fd).st_size, name)
                check_opened_size(out[i], size, f"{what} {name}")
                out[i].checked = True  # every slice validated by its reader before the file got its name
                if self.plan.from_node.get(name) is not None:
                    self.bytes_from_node += size
            for i, obj in zip(from_store, self.store.open_objects([wanted[i] for i in from_store], what)):
                out[i] = obj
        except BaseException:
            for obj in out:
                if obj is not None:
                    obj.close()
            raise
        return out  # type: ignore[return-value]

    def close(self) -> None:
        """Remove the files this rank made for its node (every rank that maps one keeps its mapping)."""
        directory = self._directories.pop(self.rank, None)
        if directory is None:
            for obj in self._held:
                obj.close()
            self._held = []
            return
        for name, _ in self.plan.for_node:
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(directory)
        except OSError:
            pass
        for obj in self._held:
            obj.close()
        self._held = []


def _copy_into_file(obj: ObjectFile, path: str, size: int, regions: Sequence[RegionDecl]) -> None:
    """``obj``'s bytes (an object store's, in this process's memory) into a new file at ``path``, every slice
    validated (BLAKE3, finiteness by ``regions``) before its name appears: the ranks that map it check its
    head, not its bytes again."""
    partial = f"{path}.partial"
    fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = obj.view()  # waits for the bytes, and refuses them if they cannot arrive
        for start in range(0, size, _COPY_CHUNK):
            chunk = view[start:start + _COPY_CHUNK]
            written = 0
            while written < len(chunk):
                written += os.pwrite(fd, chunk[written:], start + written)
        copy = ObjectFile(os.dup(fd), size, obj.digest)
        try:
            _check_object(copy, regions)
        finally:
            copy.close()
    except BaseException:
        os.close(fd)
        os.unlink(partial)
        raise
    os.close(fd)
    os.rename(partial, path)


def _check_object(obj: ObjectFile, regions: Sequence[RegionDecl]) -> None:
    """Every slice of shard ``obj``, validated as a restore validates what it reads."""
    what = f"shard {obj.digest[:16]}..."
    header, head_len = read_head(obj, what, size_is_known=True)
    head = parse_shard_header(header, obj.digest, head_len, what)
    payloads = Payloads({obj.digest: (obj, head)}, regions)
    try:
        payloads.decode([(obj.digest, i) for i in range(len(head.slices))], keep=False)
    finally:
        payloads.release()


def _barrier(group) -> None:
    flag = torch.zeros(1, dtype=torch.int64, device=wire_device(group))
    dist.all_reduce(flag, group=group)
