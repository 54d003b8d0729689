"""alpha_ckpt.dcp's StorageReader: a DCP load from a generation that :class:`alpha_ckpt.dcp.StorageWriter`
wrote. Every rank validates every chunk it will read in ``prepare_local_plan`` (gathered by DCP
before any ``read_data``), so no rank copies a byte unless every rank's reads validated.
"""
from __future__ import annotations

import dataclasses
import io
import math
import os
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader as _DcpStorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from alpha_ckpt.dcp.common import CHAINS, Chain, chain_key, close_own_store
from alpha_ckpt.generation.dcp_metadata import DCP_KEY, check_generation
from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.runtime.launch_env import note_checkpoint_call
from alpha_ckpt.format.records import DTYPES, CapturePrefix, RegionDecl, check_name
from alpha_ckpt.state.manifest import torch_dtype
from alpha_ckpt.generation.planner import WantedSlice
from alpha_ckpt.collective.node_reads import NodeReads
from alpha_ckpt.generation.opening import open_planned, plan_opening
from alpha_ckpt.generation.reader import PreparedRestore, check_structure, latest_generation, open_generation
from alpha_ckpt.state.placement import box_ranges
from alpha_ckpt.store import Store
from alpha_ckpt.runtime.teardown import exit_clean
from alpha_ckpt.format.values import decode_value


def box_words(chunk_shape: tuple[int, ...], offsets, lengths) -> tuple[int, int]:
    """Pure: the flat word range [lo, hi) of a row-major chunk that holds the box at ``offsets`` of
    ``lengths`` (first to last word of the box; exactly the box when it is contiguous)."""
    ranges = box_ranges(tuple(chunk_shape), tuple(int(o) for o in offsets), tuple(int(n) for n in lengths))
    return (ranges[0][0], ranges[-1][1]) if ranges else (0, 0)


class StorageReader(_DcpStorageReader):
    """Reads a DCP checkpoint that :class:`~alpha_ckpt.dcp.StorageWriter` wrote: generation ``root``
    (its root digest), or the newest complete one of ``run``/``step`` (``root="latest"``; every rank
    must find the same).

    ``dcp.load(..., checkpoint_id=root)`` names the generation too. The reader runs no collective
    of its own: each rank validates what it will read in ``prepare_local_plan``, and DCP's own plan
    exchange (over its ``process_group``) raises any rank's refusal on every rank before any rank
    reads.

    ``group``: the process group ``dcp.load`` runs over (``dist.group.WORLD`` for the default one). Given,
    each object is read from the store once per node, as a Checkpointer's restore does
    (:mod:`alpha_ckpt.collective.node_reads`): the ranks plan who reads what over ``group`` in
    ``prepare_local_plan``. Without it every rank reads what it loads (DCP does not tell a reader its group).
    """

    def __init__(self, store: str | os.PathLike | Store, root: str = "latest", *, run: str | None = None,
                 step: str = "train", group: Any = None):
        note_checkpoint_call()  # under alpha-run: a failure from here on is retryable (launch_env)
        if root == "latest" and run is None:
            raise ValueError("StorageReader(root='latest') needs run= (or pass root=<root digest>)")
        self.run, self.step = (None if run is None else check_name(run, "run")), check_name(step, "step")
        self.wanted_root, self.group = root, group
        self._store_arg, self._store = store, store if isinstance(store, Store) else None
        exit_clean()  # DCP's collectives over gloo: the process leaves them cleanly at exit (alpha_ckpt.runtime.teardown)
        self.root: str | None = None  # the generation read_metadata chose; ``prefix`` its run/step/update/cursor/epoch
        self.prefix: CapturePrefix | None = None
        self.regions: tuple[RegionDecl, ...] = ()
        self.bytes_read = 0  # stored bytes of the chunks the last read_data validated
        self._validated: _Validated | None = None  # prepare_local_plan's, for read_data
        self._failure: Exception | None = None  # read_metadata's, raised by set_up_storage_reader
        self._loaded: tuple | None = None  # (chain key, history) a save continues once this load succeeded

    # DCP's call order: reset, read_metadata, set_up_storage_reader, prepare_local_plan,
    # (coordinator) prepare_global_plan, read_data.
    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.wanted_root = str(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def _open_store(self) -> Store:
        if self._store is None:
            self._store = Store(self._store_arg, create=False)
        return self._store

    def _choose_root(self) -> str:
        if self.wanted_root != "latest":
            return Store.check_digest(self.wanted_root)
        # Each rank chooses (heads only: each validates the payload bytes it reads, in read_data); the
        # coordinator checks in prepare_global_plan that every rank chose the same. No collective here:
        # DCP does not say which process group (if any: no_dist=True) it loads over.
        record, _ = latest_generation(self._open_store(), self.run, self.step, check=check_structure)
        if record is None:
            raise Refusal(RefusalCode.MISSING_SHARD, f"{self.run}/{self.step} has no complete generation")
        return record.root

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP turns any exception raised here into an AssertionError ("metadata is None") and loses the
        # Refusal: it is raised from set_up_storage_reader instead, which DCP reports as it is.
        self._failure = None
        try:
            return self._read_metadata()
        except Exception as exc:  # noqa: BLE001 - raised again, whole, by set_up_storage_reader
            self._failure = exc
            return Metadata(state_dict_metadata={})

    def _read_metadata(self) -> Metadata:
        self.root = self._choose_root()
        store = self._open_store()
        with open_generation(store, self.root, wanted=[]) as generation:  # checks the DCP Metadata too
            manifest = generation.manifest
        if not isinstance(manifest.metadata, dict) or DCP_KEY not in manifest.metadata:
            raise Refusal(RefusalCode.FORMAT, f"generation {self.root[:16]}... was not written by DCP (no "
                          f"{DCP_KEY!r} metadata): restore it with alpha_ckpt.Checkpointer or alpha_ckpt.restore")
        self.regions, self.prefix = manifest.regions, manifest.prefix
        # The history a save of this process continues once the load succeeds (as a Checkpointer's restore):
        # the next epoch, after the newest generation; none if a newer continuation superseded this one.
        p = manifest.prefix
        history = store.history(p.run, p.step, whole=False)
        newest, stale = history.newest, None
        if newest is not None and newest.prefix.epoch > p.epoch:
            stale = (f"this process loaded generation {self.root[:16]}... of epoch {p.epoch}, but {p.run}/{p.step} "
                     f"generation {newest.generation} (update {newest.prefix.update}) is of epoch "
                     f"{newest.prefix.epoch}, a newer continuation that owns it")
        follows = history.top  # an unreadable newest ref's number stays taken
        self._loaded = (chain_key(store, p.run, p.step), Chain(p.epoch + 1, follows, stale))
        return check_generation(manifest, f"generation {self.root[:16]}... DCP metadata")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Validate every chunk this rank will read (nothing copied yet). DCP gathers the local plans over
        its own process group before any rank reads: a refusal here is raised on every rank with no
        destination touched, and the backend needs no collective of its own."""
        self._release_validated()
        self._validated = self._validate(plan)
        return dataclasses.replace(plan, storage_data={"root": self.root})

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        roots = {p.storage_data.get("root") for p in plans if isinstance(p.storage_data, dict)}
        if len(roots) > 1:  # "latest" moved between two ranks' choices: retryable, nothing was read
            raise RuntimeError(f"the ranks chose different newest generations of {self.run}/{self.step} (one was "
                               "published as the load started): load again")
        return plans

    def _validate(self, plan: LoadPlan) -> "_Validated":
        wanted, boxes, values = [], [], []
        generation = None
        try:
            for item in plan.items:
                data = self.storage_data.get(item.storage_index)
                if not isinstance(data, dict):
                    raise Refusal(RefusalCode.COVERAGE, f"generation {self.root[:16]}... holds no {item.storage_index.fqn!r} "
                                  f"at {list(item.storage_index.offset or [])}")
                if item.type == LoadItemType.BYTE_IO:
                    values.append((item, decode_value(data["value"], f"DCP entry {item.dest_index.fqn!r}")))
                    continue
                region = self.regions[data["region"]]
                lo, hi = box_words(region.shape, item.storage_offsets, item.lengths)
                wanted.append(WantedSlice(region.ordinal, lo, hi, len(wanted)))
                boxes.append((item, region, lo))
            store = self._open_store()
            opening = plan_opening(store, self.root, wanted=wanted)
        except Exception as exc:  # noqa: BLE001 - raised again below, once every rank took part in the plan
            opening, refused = None, self._refusal_of(exc)
            if self.group is None:
                close_own_store(self)
                if refused is exc:
                    raise
                raise refused from None
        else:
            refused = None
        shared = None
        try:
            if self.group is not None:  # every rank, refused or not: the plan is collective
                shared = NodeReads.share(self._open_store(), None if opening is None else opening.objects(),
                                         self.group, self.regions)
            if refused is not None:
                raise refused
            generation = open_planned(store, opening, None if shared is None else shared.open_objects)
            prepared = PreparedRestore(generation, wanted)
        except BaseException:
            if generation is not None:
                generation.close()
            if shared is not None:
                shared.close()
            close_own_store(self)
            raise
        # Another rank's refusal reaches this one as DCP's exception, with no call to read_data: what
        # this rank validated is then let go with the reader (or at its next load).
        release = weakref.finalize(self, _release_prepared, prepared, generation, shared)
        return _Validated(_plan_key(plan), wanted, boxes, values, prepared, release, shared)

    def _refusal_of(self, exc: BaseException) -> BaseException:
        """A malformed DCP storage entry as the refusal it is; any other exception as it is."""
        if isinstance(exc, (KeyError, TypeError, IndexError)):
            return Refusal(RefusalCode.FORMAT, f"generation {self.root[:16]}... DCP storage data is malformed "
                           f"({type(exc).__name__}: {exc})")
        return exc

    def _release_validated(self) -> None:
        if self._validated is not None:
            self._validated.release()
            self._validated = None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Copy what prepare_local_plan validated (every rank validated its part before any rank got here)."""
        try:
            validated, self._validated = self._validated, None
            if validated is None or validated.key != _plan_key(plan):
                # A planner that changed this rank's plan after it was validated: validated here, by this
                # rank alone (another rank may already be copying).
                if validated is not None:
                    validated.release()
                validated = self._validate(plan)
            try:
                self._copy(validated, planner)
            finally:
                validated.release()
        finally:
            close_own_store(self)  # read_data is a load's last call on every rank
        key, chain = self._loaded
        CHAINS[key] = chain
        future: Future = Future()
        future.set_result(None)
        return future

    def _copy(self, validated: "_Validated", planner: LoadPlanner) -> None:
        wanted, boxes, prepared = validated.wanted, validated.boxes, validated.prepared
        # A box that is one word range, bound for a contiguous CPU destination of its dtype (row
        # blocks, FSDP2's shards), is copied straight into it; any other goes through a buffer.
        targets, buffers = [], []
        for w, (item, region, _) in zip(wanted, boxes):
            dest = planner.resolve_tensor(item).detach()
            direct = (dest.device.type == "cpu" and dest.is_contiguous() and dest.numel() == w.hi - w.lo
                      and dest.dtype == torch_dtype(region.dtype))
            buf = dest.reshape(-1).view(torch.uint8) if direct else \
                torch.empty((w.hi - w.lo) * DTYPES[region.dtype][0], dtype=torch.uint8)
            targets.append((dest, direct))
            buffers.append(buf)
        self.bytes_read = prepared.bytes_read
        prepared.copy_into(buffers)
        for buf, (dest, direct), (item, region, lo) in zip(buffers, targets, boxes):
            if not direct:
                words = buf.view(torch_dtype(region.dtype))
                strides = [math.prod(region.shape[d + 1:]) for d in range(len(region.shape))]
                start = sum(o * s for o, s in zip(item.storage_offsets, strides)) - lo
                source = words.as_strided(tuple(item.lengths), strides, start) if words.numel() else \
                    torch.empty(tuple(item.lengths), dtype=words.dtype)
                dest.copy_(source)
            planner.commit_tensor(item, dest)
        for item, value in validated.values:
            _load_value(planner, item, value)


@dataclasses.dataclass
class _Validated:
    """What one rank's prepare_local_plan validated for its read_data: the slices, held, and how to copy them."""
    key: list
    wanted: list
    boxes: list
    values: list
    prepared: PreparedRestore
    release: Any  # a finalizer: releases the validated slices and closes their shards, once
    shared: NodeReads | None = None  # the objects this rank read for its node (removed once every rank opened)


def _release_prepared(prepared: PreparedRestore, generation, shared: NodeReads | None = None) -> None:
    try:
        prepared.release()
    finally:
        generation.close()
        if shared is not None:
            shared.close()


def _plan_key(plan: LoadPlan) -> list:
    return [(i.type, i.storage_index, tuple(i.storage_offsets), tuple(i.dest_offsets), tuple(i.lengths))
            for i in plan.items]


def _load_value(planner: LoadPlanner, item, value: Any) -> None:
    """Hand a non-tensor value to the planner without torch.load: DCP's default planner gets it set
    directly (what its load_bytes does after unpickling); another planner gets an in-memory
    torch.save of the decoded value (never bytes read from disk)."""
    if type(planner).load_bytes is DefaultLoadPlanner.load_bytes:
        if planner.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper
            set_element(planner.original_state_dict, planner.mappings[item.dest_index.fqn], value)
        else:
            planner.state_dict[item.dest_index.fqn] = value
        return
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    planner.load_bytes(item, buf)
