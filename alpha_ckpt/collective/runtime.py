"""What a Checkpointer runs on, built from its options and its process group alone.

The store, the process groups of its own, the asynchronous saver, the publisher and the tiers a
save walks are made in one place, in one order, by :func:`build_runtime`, so the Checkpointer only
calls them, and a new tier or backend is added here, not as a branch in its save or restore.
Building is collective: every rank of ``group`` calls it, in the same order.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

from alpha_ckpt.collective.arrival import Arrivals, group_timeout
from alpha_ckpt.collective.options import CheckpointerOptions
from alpha_ckpt.collective.verdict import agree_usage
from alpha_ckpt.errors import UsageError
from alpha_ckpt.generation.async_save import AsyncSaver
from alpha_ckpt.generation.planner import Hierarchy
from alpha_ckpt.generation.writer import ShardCarry
from alpha_ckpt.runtime.teardown import on_exit
from alpha_ckpt.state.device import current_device
from alpha_ckpt.store import Store
from alpha_ckpt.tiers.durable.publisher import Publisher
from alpha_ckpt.tiers.durable.star import StarPublisher
from alpha_ckpt.tiers.durable.tier import DurableTier
from alpha_ckpt.tiers.durable.tree import TreePublisher
from alpha_ckpt.tiers.durable.wire import broadcast_json, global_rank
from alpha_ckpt.tiers.memory.tier import MemoryTier, memory_directory, replica_stride
from alpha_ckpt.tiers.seam import Tier

logger = logging.getLogger("alpha_ckpt")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """The parts of one Checkpointer, made by :func:`build_runtime`.

    ``store`` is closed by the Checkpointer only when ``own_store`` (a ``Store`` given is the
    caller's). ``control`` carries the tree's messages (gloo beside NCCL, else the script's group);
    ``saver`` and ``save_group`` exist under ``save="async"``; ``memory`` when the memory tier is on
    and the store has an instance id. ``tiers``: where generations live, fastest first. ``release``
    joins the saver's thread and destroys the groups made here (also at exit)."""
    group: Any
    rank: int
    world: int
    hierarchy: Hierarchy
    arrivals: Arrivals
    store: Store
    own_store: bool
    control: Any
    saver: AsyncSaver | None
    save_group: Any
    memory: MemoryTier | None
    carry: ShardCarry
    device: torch.device
    durable: DurableTier
    tiers: tuple[Tier, ...]
    release: weakref.finalize


def build_runtime(options: CheckpointerOptions, group: Any, owner: object) -> Runtime:
    """The runtime of ``options`` on ``group`` (default: the default group); ``owner``: the object whose
    collection releases it (the Checkpointer)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hierarchy = Hierarchy(world, options.fanout)
    arrivals = Arrivals(group, rank, world)  # save and restore name the ranks that did not come
    own_store = not isinstance(options.store, Store)
    store = options.store if not own_store else open_store(options.store, rank, group)
    # Tree messages and an asynchronous save's publish go over gloo groups of their own:
    # NCCL moves only device memory and cannot time out a receive, and a background
    # publish must never interleave with the training collectives of the main thread.
    ranks = None if group is None else dist.get_process_group_ranks(group)
    nccl = dist.get_backend(group) == "nccl"
    # The groups made here wait as long as the script's group does (new_group's own default is 30 minutes).
    timeout = group_timeout(group)
    control = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout) if nccl else group
    asynchronous = options.save == "async"
    saver = AsyncSaver(in_flight=options.in_flight) if asynchronous else None
    save_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout) if asynchronous else None
    # The memory tier, on a gloo group of its own: its copies between peers never interleave with
    # the training's collectives or a background publish's messages.
    tier_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout) if options.memory is not None else None
    memory = None
    if options.memory is not None:
        # A memory generation belongs to one store: it is taken only with this store's instance id.
        instance = broadcast_json(store.instance if rank == 0 else None, global_rank(0, tier_group), tier_group)
        if instance is None:
            if rank == 0:
                logger.warning("memory tier off: store %s has no instance id (it is read-only, or older and not "
                               "opened writable since)", store.root)
        else:
            memory = MemoryTier(memory_directory(options, store.root), store=store, instance=instance, rank=rank,
                                world=world, copies=1 + options.replicas, stride=replica_stride(world),
                                group=tier_group, identity=options.identity)
    # Never closed: at exit, while the interpreter is still whole, the save thread is joined and the
    # groups made here are destroyed, before the default group (alpha_ckpt.runtime.teardown).
    release = weakref.finalize(owner, release_runtime, saver,
                               [g for g in (save_group, tier_group, control if nccl else None) if g])
    on_exit(release)
    device = current_device(torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
    # What this process wrote before: a region whose bytes did not change (a frozen embedding
    # table) is named again as carried instead of written again (one save in flight at a time).
    carry = ShardCarry()
    publisher: Publisher = (
        TreePublisher(store, hierarchy, rank, device=device, timeout=options.commit_timeout, carry=carry,
                      identity=options.identity) if options.publisher == "tree" else
        StarPublisher(store, rank, world, carry=carry, identity=options.identity))
    durable = DurableTier(store, publisher, rank, group, options.save_timeout)
    return Runtime(group=group, rank=rank, world=world, hierarchy=hierarchy, arrivals=arrivals, store=store,
                   own_store=own_store, control=control, saver=saver, save_group=save_group, memory=memory,
                   carry=carry, device=device, durable=durable,
                   tiers=tuple(t for t in (memory, durable) if t is not None), release=release)


def open_store(path: str | os.PathLike, rank: int, group: Any) -> Store:
    """Collective: rank 0 creates the store, then the others open it. A path that cannot be a store (a
    file) is the same UsageError on every rank, and no rank is left waiting in a collective the others
    left, so the next Checkpointer of these processes starts in step."""
    store = error = None
    if rank == 0:
        try:
            store = Store(path, create=True)
        except UsageError as exc:
            error = exc
    agree_usage(error, group)  # also the barrier: the store exists before the others open it
    if rank != 0:
        try:
            store = Store(path, create=False)
        except UsageError as exc:
            error = exc
    try:
        agree_usage(error, group)
    except UsageError:
        if store is not None:
            store.close()
        raise
    return store


def release_runtime(saver: AsyncSaver | None, groups: list) -> None:
    """Join an asynchronous saver's thread and destroy the process groups a runtime made."""
    if saver is not None:
        saver.close()
    for group in groups:
        try:
            if dist.is_initialized():
                dist.destroy_process_group(group)
        except (RuntimeError, ValueError) as exc:  # already gone with the default group
            logger.debug("process group not destroyed: %s", exc)
