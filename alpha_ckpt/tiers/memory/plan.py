"""Who sends which object to whom: replication after a memory save, fetches before a recovery.

Pure: no I/O. Every rank computes the same plan from the same inputs, so the transfers that
carry it out (:mod:`alpha_ckpt.tiers.memory.transfer`) need no agreement of their own.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import AbstractSet, Iterable, Iterator, Mapping, Sequence


@dataclass(frozen=True)
class Transfer:
    digest: str  # the object's BLAKE3 name (64 hex)
    size: int    # its size in bytes
    src: int     # the rank that sends its copy
    dst: int     # the rank that stores it


def _check_world(world: int, stride: int) -> None:
    if world < 1:
        raise ValueError(f"world must be at least 1, not {world}")
    if stride < 1:
        raise ValueError(f"stride must be at least 1, not {stride}")


def _check_rank(rank: int, world: int, what: str) -> None:
    if not 0 <= rank < world:
        raise ValueError(f"{what} {rank} is not a rank of a world of {world}")


def peer_order(holder: int, world: int, stride: int = 1) -> Iterator[int]:
    """Every rank but ``holder``, once each: holder+stride, holder+2*stride, ... (mod world), then, where
    that cycle came back to ``holder`` early (stride shares a factor with world), the same cycle from
    holder+1, holder+2, ... So with stride = ranks per node the first ranks named lie on distinct nodes."""
    _check_world(world, stride)
    _check_rank(holder, world, "holder")  # checked now, not when the first rank is asked for
    return _cycles(holder, world, stride)


def _cycles(holder: int, world: int, stride: int) -> Iterator[int]:
    cycle = world // gcd(stride, world)  # ranks one cycle of +stride visits before it comes back
    for offset in range(world // cycle):  # one start per coset of the cycle: together they cover every rank
        for k in range(1, cycle + 1):
            rank = (holder + offset + k * stride) % world
            if rank != holder:
                yield rank


def replica_targets(holder: int, world: int, copies: int, stride: int = 1) -> list[int]:
    """The ranks that hold copies of what ``holder`` writes, besides itself: min(copies, world) - 1
    distinct ranks != holder, in order holder+stride, holder+2*stride, ... (mod world); when that
    cycle revisits ranks (stride shares a factor with world), continue from holder+1+stride... so
    the answer always has the full count. With stride = ranks per node and several nodes, the
    first min(copies, nnodes) - 1 targets are on distinct other nodes."""
    if copies < 1:
        raise ValueError(f"copies must be at least 1, not {copies}")
    order = peer_order(holder, world, stride)
    return [next(order) for _ in range(min(copies, world) - 1)]


def _unique_objects(objects: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """The objects by digest, each once (sorted: every rank orders them alike however it listed them)."""
    sizes: dict[str, int] = {}
    for digest, size in objects:
        if sizes.setdefault(digest, size) != size:
            raise ValueError(f"object {digest} is listed with sizes {sizes[digest]} and {size}")
    return sorted(sizes.items())


def plan_replication(objects: Sequence[tuple[str, int]], holders: Mapping[str, AbstractSet[int]],
                     world: int, copies: int, stride: int = 1,
                     everywhere: AbstractSet[str] = frozenset()) -> list[Transfer]:
    """Transfers that leave every object held by min(copies, world) distinct ranks (objects in
    ``everywhere``, the manifests, by every rank). Deterministic (every rank computes the same list
    from the same inputs; objects in digest order). Each object's source is one of its holders (its
    lowest-numbered one); its new holders are that holder's :func:`replica_targets`, skipping ranks
    that hold it already (then further ranks in the same cyclic order until the count is reached).
    An object with no holder yields no transfer (the caller counts it as missing)."""
    _check_world(world, stride)
    if copies < 1:
        raise ValueError(f"copies must be at least 1, not {copies}")
    transfers = []
    for digest, size in _unique_objects(objects):
        held = holders.get(digest, frozenset())
        if not held:
            continue
        for rank in held:
            _check_rank(rank, world, f"holder of {digest}")
        wanted = world if digest in everywhere else min(copies, world)
        src = min(held)
        short = wanted - len(held)
        if short <= 0:
            continue
        for dst in peer_order(src, world, stride):
            if dst in held:
                continue
            transfers.append(Transfer(digest, size, src, dst))
            short -= 1
            if short == 0:
                break
    return transfers


@dataclass(frozen=True)
class FetchPlan:
    transfers: list[Transfer]
    missing: list[str]  # needed digests no rank holds, sorted


def plan_fetch(sizes: Mapping[str, int], holders: Mapping[str, AbstractSet[int]],
               needs: Mapping[int, AbstractSet[str]]) -> FetchPlan:
    """What each rank pulls: for every rank r and every digest in needs[r] that r does not hold,
    one transfer from a holder; the holder chosen is the one that has sent the fewest bytes so far
    in this plan (ties: lowest rank), so the load spreads over the holders. Deterministic (ranks
    and digests in sorted order). Only the holders given send: a rank that pulls a copy in this
    plan is no source for another rank's pull of it."""
    sent: dict[int, int] = {}
    transfers: list[Transfer] = []
    missing: set[str] = set()
    for rank in sorted(needs):
        for digest in sorted(needs[rank]):
            held = holders.get(digest, frozenset())
            if rank in held:
                continue
            if not held:
                missing.add(digest)
                continue
            if digest not in sizes:
                raise ValueError(f"object {digest} is needed and held but its size is not given")
            src = min(held, key=lambda h: (sent.get(h, 0), h))
            sent[src] = sent.get(src, 0) + sizes[digest]
            transfers.append(Transfer(digest, sizes[digest], src, rank))
    return FetchPlan(transfers, sorted(missing))


def under_held(objects: Iterable[str], holders: Mapping[str, AbstractSet[int]], minimum: int = 2) -> list[str]:
    """The objects held by fewer than ``minimum`` distinct ranks (sorted): a memory generation counts
    as recoverable only when this is empty."""
    return sorted({digest for digest in objects if len(holders.get(digest, ())) < minimum})


def transfer_windows(transfers: Sequence[Transfer], window_bytes: int) -> list[tuple[int, int]]:
    """The transfers cut into consecutive windows [start, stop), each as long as it can be while no
    rank sends and receives more than ``window_bytes`` in it together (one transfer larger than that
    is all its two ranks do in its window): the bytes a rank holds in flight at once. Every rank
    cuts the same list the same way."""
    windows: list[tuple[int, int]] = []
    start = 0
    load: dict[int, int] = {}
    for index, t in enumerate(transfers):
        if index > start and max(load.get(t.src, 0), load.get(t.dst, 0)) + t.size > window_bytes:
            windows.append((start, index))
            start, load = index, {}
        load[t.src] = load.get(t.src, 0) + t.size
        load[t.dst] = load.get(t.dst, 0) + t.size
    if start < len(transfers):
        windows.append((start, len(transfers)))
    return windows


def split_by_reach(transfers: Sequence[Transfer], readable: AbstractSet[tuple[int, int]]) -> tuple[list[Transfer],
                                                                                                  list[Transfer]]:
    """The transfers whose destination reads the source's holder directly (``(dst, src)`` in ``readable``:
    ranks of one node sharing the tier's tmpfs), and the others, which go over the network; order kept."""
    through_files = [t for t in transfers if (t.dst, t.src) in readable]
    over_network = [t for t in transfers if (t.dst, t.src) not in readable]
    return through_files, over_network


def network_needs(needs: Mapping[int, AbstractSet[str]], holders: Mapping[str, AbstractSet[int]],
                  readable: AbstractSet[tuple[int, int]]) -> dict[int, frozenset[str]]:
    """What each rank must pull over the network for a restore: what it needs, holds not, and no rank
    whose holder it reads (``(rank, holder)`` in ``readable``) holds either (those it reads in place)."""
    out = {}
    for rank, wanted in needs.items():
        out[rank] = frozenset(d for d in wanted
                              if not any(h == rank or (rank, h) in readable for h in holders.get(d, ())))
    return out
