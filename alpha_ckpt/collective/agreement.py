"""Capture and agreement: what each rank holds of a save, and the one layout every rank then writes.

Every rank captures its state and sends rank 0 a
:class:`~alpha_ckpt.tiers.durable.messages.Descriptor` (its skeleton, region
declarations and the word ranges it writes; never tensor bytes). Rank 0
checks that every capture agrees (:func:`merge_captures`) and answers with
one :class:`~alpha_ckpt.tiers.durable.messages.Layout`: the merged skeleton, the
region list, which rank wrote which words (:func:`saved_layout`) and the
write mode, or the refusal every rank raises. Large replicas are spread over
the ranks (:func:`replica_writers`), as DCP spreads them; so are the shards
that several ranks hold alike (:func:`shared_piece_writers`: HSDP's replicas,
FSDP-only modules of a (dp, tp) mesh), one writer each, as DCP's planner dedups
them, and every holder's digest compared.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping, Sequence

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import CapturePrefix, DTYPES, RegionDecl, block_digests, joined_digest
from alpha_ckpt.state.manifest import check_coverage, check_region_names
from alpha_ckpt.generation.planner import Piece, shares
from alpha_ckpt.tiers.durable.messages import Descriptor, Layout, Outcome, per_rank_hint, short
from alpha_ckpt.tiers.durable.wire import global_rank
from alpha_ckpt.tiers.durable.wire import broadcast_json, gather_json
from alpha_ckpt.store import Store
from alpha_ckpt.format.values import decode_value, dotted_leaves

SPREAD_BYTES = 1 << 20  # replicated regions this large are spread over the ranks (star and tree)

# One rank's words of one save: (region name, lo, hi, bytes).
Own = list[tuple[str, int, int, memoryview]]
# Words [lo, hi) of a region that several ranks hold alike, by (name, lo, hi): the rank that writes them.
SharedWriters = dict[tuple[str, int, int], int]


def describe(prefix: CapturePrefix, captured: Any, regions: Sequence[RegionDecl], views: Sequence[memoryview],
             rank: int, world: int, device: Any) -> tuple[Descriptor, Own, list, dict]:
    """This rank's descriptor, the words it holds to write (``own``: the agreement may give pieces that
    other ranks hold alike to one of them, :func:`split_shared`), the replicas it only hashes (``hashed``,
    (name, bytes)) and those it writes (``wrote``, name -> bytes)."""
    own: Own = []
    hashed, wrote, replicated, dtensors = [], {}, [], []
    writers = replica_writers(regions, captured.placement, world)
    for region, view, where in zip(regions, views, captured.placement):
        size = DTYPES[region.dtype][0]
        if where == "replicated":
            replicated.append(region.name)
            if writers.get(region.name, 0) == rank:
                own.append((region.name, 0, region.words, view))
                wrote[region.name] = view
            else:
                hashed.append((region.name, view))
        else:
            if where[0] == "dtensor":
                dtensors.append(region.name)
            for lo, hi, at in words_held(where, region.words):
                own.append((region.name, lo, hi, view[at * size:(at + hi - lo) * size]))
    descriptor = Descriptor(prefix=prefix.to_json(), skeleton=captured.skeleton, replicated=replicated,
                            regions=[r.to_json() for r in regions], pieces=[[n, lo, hi] for n, lo, hi, _ in own],
                            dtensors=dtensors, device=device)
    return descriptor, own, hashed, wrote


def agree_layout(descriptor: Descriptor, group: Any, rank: int, store: Store, world: int,
                 refused: BaseException | None = None) -> Layout:
    """Collective: rank 0 gets every rank's descriptor, checks that the captures agree and merges them
    into one skeleton and region list; every rank gets that, or raises the same Refusal (a capture
    that failed on any rank included, the lowest rank's as :func:`~alpha_ckpt.collective.verdict.agree`)."""
    root0 = global_rank(0, group)
    descriptors = gather_json(descriptor.to_json(), root0, group)
    if rank != 0:
        layout = Layout.from_json(broadcast_json(None, root0, group))
    else:
        try:
            descriptors = [Descriptor.from_json(d) for d in descriptors]
            failed = [d.refused for d in descriptors if d.refused is not None]
            if failed:
                layout = Layout(failed[0])
            else:
                skeleton, regions, shared = merge_captures(descriptors)
                layout = Layout(Outcome.success(), state=skeleton, regions=[r.to_json() for r in regions],
                                devices=[d.device for d in descriptors],
                                layout=saved_layout(descriptors, regions, shared),
                                shared=[[name, lo, hi, writer] for (name, lo, hi), writer in shared.items()],
                                # every rank writes this save's large shards alike, beyond its own probes
                                write_mode=store.write_modes.for_save(world))
        except Refusal as refusal:
            layout = Layout(Outcome.of(refusal))
        except Exception as exc:  # noqa: BLE001 - the others wait for this verdict: never leave them waiting
            layout = Layout(Outcome.of(exc, 0))
        # Every rank writes its own shards against the agreed regions.
        broadcast_json(layout.to_json(), root0, group, echo=False)
    layout.outcome.raise_failure(refused)
    return layout


def agreed_regions(layout: Layout) -> tuple[RegionDecl, ...]:
    return tuple(RegionDecl(r["ordinal"], r["name"], r["dtype"], tuple(r["shape"]), bool(r.get("nonfinite")))
                 for r in layout.regions)


def own_parts(regions: Sequence[RegionDecl], own: Own) -> list[tuple[Piece, memoryview, str]]:
    """This rank's words as the writer takes them (uncompressed pieces of the agreed regions)."""
    by_name = {r.name: r for r in regions}
    return [(Piece(by_name[n].ordinal, lo, hi, DTYPES[by_name[n].dtype][0]), view, "raw") for n, lo, hi, view in own]


def split_shared(layout: Layout, rank: int, own: Own) -> tuple[Own, Own, Own]:
    """This rank's words to write (``own`` less the shared pieces another rank writes), the shared
    pieces among them, and the shared pieces it only hashes (each part of ``own``)."""
    writers = {(name, lo, hi): writer for name, lo, hi, writer in layout.shared}
    kept, wrote, hashed = [], [], []
    for part in own:
        writer = writers.get(part[:3])
        if writer is None or writer == rank:
            kept.append(part)
            if writer is not None:
                wrote.append(part)
        else:
            hashed.append(part)
    return kept, wrote, hashed


def _by_ordinal(written: Mapping[tuple, str]) -> dict[int, list[tuple[int, int, str]]]:
    by_ordinal: dict[int, list[tuple[int, int, str]]] = {}  # one pass over the pieces, not one per replica
    for (o, lo, hi), d in written.items():
        by_ordinal.setdefault(o, []).append((lo, hi, d))
    return by_ordinal


def _written_digest(cuts_of_region: Sequence[tuple[int, int, str]], lo: int, hi: int, view: memoryview) -> str:
    """The digest of words [lo, hi) as the write hashed them (joined from its cuts when it cut them into
    several shards; cuts start at lo in whole blocks), else hashed here."""
    cuts = sorted(c for c in cuts_of_region if lo <= c[0] and c[1] <= hi)
    covered = bool(cuts) and [c[0] for c in cuts] == [lo] + [c[1] for c in cuts[:-1]] and cuts[-1][1] == hi
    return joined_digest([d for *_, d in cuts]) if covered else block_digests(view)[0]


def replica_digests(regions: Sequence[RegionDecl], wrote: Mapping[str, memoryview], written: Mapping[tuple, str],
                    others: Mapping[str, str]) -> dict[str, str]:
    """This rank's BLAKE3 of every replica: those it wrote as hashed by the write (joined from its
    cuts when it was cut into several shards), and the others' (``others``)."""
    by_name = {r.name: r for r in regions}
    digests = dict(others)
    by_ordinal = _by_ordinal(written)
    for name, view in wrote.items():
        region = by_name[name]
        digests[name] = _written_digest(by_ordinal.get(region.ordinal, ()), 0, region.words, view)
    return digests


def shared_digests(regions: Sequence[RegionDecl], wrote: Own, written: Mapping[tuple, str],
                   others: Sequence[list]) -> list[list]:
    """This rank's [name, lo, hi, BLAKE3] of every shared piece it holds: those it wrote as the write
    hashed them, and the others' (``others``, hashed beside the writes)."""
    ordinals = {r.name: r.ordinal for r in regions}
    by_ordinal = _by_ordinal(written)
    return [*others, *([name, lo, hi, _written_digest(by_ordinal.get(ordinals[name], ()), lo, hi, view)]
                       for name, lo, hi, view in wrote)]


def merge_skeletons(skeletons: list[Any], path: str = "state") -> Any:
    """One skeleton from every rank's: PerRank parts from their own ranks, everything else equal on all."""
    first = skeletons[0]
    if len(skeletons) == 1:  # one rank's skeleton is the merge (its PerRank lists hold its one part)
        return first
    if isinstance(first, dict) and set(first) == {"per_rank"}:
        parts = []
        for r, s in enumerate(skeletons):
            if not (isinstance(s, dict) and set(s) == {"per_rank"} and len(s["per_rank"]) == len(skeletons)):
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"{path}: rank {r} does not hold it per rank as rank 0 does")
            parts.append(s["per_rank"][r])
        return {"per_rank": parts}
    if isinstance(first, dict):
        for r, s in enumerate(skeletons):
            if not isinstance(s, dict) or set(s) != set(first):
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"{path}: rank {r}'s state differs from rank 0's")
        if set(first) == {"dict"} and isinstance(first["dict"], list):  # a dict's [key, value] pairs
            pairs = [s["dict"] for s in skeletons]
            keys = [p[0] if isinstance(p, list) and len(p) == 2 else p for p in first["dict"]]
            for r, theirs in enumerate(pairs):
                if not isinstance(theirs, list) or [p[0] if isinstance(p, list) and len(p) == 2 else p
                                                    for p in theirs] != keys:
                    raise Refusal(RefusalCode.MIXED_CAPTURE, f"{path}: rank {r}'s state differs from rank 0's")
            return {"dict": [[key, merge_skeletons([theirs[i][1] for theirs in pairs], f"{path}.{key}")]
                             for i, key in enumerate(keys)]}
        # Any other dict of a skeleton is one typed value ({"float": ...}, {"tuple": [...]}): its tag is no name.
        return {k: merge_skeletons([s[k] for s in skeletons], path) for k in first}
    if isinstance(first, list):
        for r, s in enumerate(skeletons):
            if not isinstance(s, list) or len(s) != len(first):
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"{path}: rank {r}'s state differs from rank 0's")
        return [merge_skeletons([s[i] for s in skeletons], path) for i in range(len(first))]
    for r, s in enumerate(skeletons):
        if s != first or type(s) is not type(first):
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"{path}: rank {r} holds {short(s)}, rank 0 {short(first)} "
                          + per_rank_hint(path.partition(".")[2] or path))
    return first


def merge_captures(descriptors: Sequence[Descriptor]) -> tuple[Any, tuple[RegionDecl, ...], SharedWriters]:
    """Rank 0 (pure): every rank's capture must have the same prefix, replicas (by digest) and
    replicated values; the result is one skeleton, the region list it names, in order, and the one
    writer of each DTensor shard that several ranks hold alike (:func:`shared_piece_writers`).

    Before any rank writes: a region every rank declares alike (a Partitioned one of one shape),
    names unique across ranks, and the ranks' pieces holding every word of every region exactly
    once (:func:`~alpha_ckpt.state.manifest.check_coverage`, which the root manifest passes again)."""
    first = descriptors[0]
    for r, d in enumerate(descriptors):
        if d.prefix != first.prefix:
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {r} captured {d.prefix}, rank 0 {first.prefix}")
        if d.replicated != first.replicated:
            raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {r} replicates {short(d.replicated)}, rank 0 "
                          f"{short(first.replicated)}")
    skeleton = merge_skeletons([d.skeleton for d in descriptors])
    names = [name for name, _ in dotted_leaves(decode_value(skeleton, "merged skeleton"))]
    check_region_names([RegionDecl(i, n, "uint8", ()) for i, n in enumerate(names)], "save")
    declared: dict[str, tuple[int, dict]] = {}
    for rank, d in enumerate(descriptors):
        for r in d.regions:
            at, decl = declared.setdefault(r["name"], (rank, r))
            if (r["dtype"], list(r["shape"])) != (decl["dtype"], list(decl["shape"])):
                raise Refusal(RefusalCode.MIXED_CAPTURE, f"rank {rank} holds region {r['name']!r} as "
                              f"{r['dtype']}{list(r['shape'])}, rank {at} as {decl['dtype']}{list(decl['shape'])}")
    regions = tuple(RegionDecl(i, n, declared[n][1]["dtype"], tuple(declared[n][1]["shape"]),
                               bool(declared[n][1].get("nonfinite"))) for i, n in enumerate(names))
    ordinals = {r.name: r.ordinal for r in regions}
    # The same DTensor shard on several ranks counts once (one of them writes it): a sub-mesh's or HSDP's
    # replicas. Anything else held twice (a Partitioned range, pieces that overlap unequal) is saved twice.
    shared = shared_piece_writers(descriptors, regions)
    slices = [(ordinals.get(name, len(regions)), lo, hi, f"rank {rank}") for rank, d in enumerate(descriptors)
              for name, lo, hi in d.pieces if shared.get((name, lo, hi), rank) == rank]
    check_coverage(regions, slices, "save")
    return skeleton, regions, shared


def shared_piece_writers(descriptors: Sequence[Descriptor], regions: Sequence[RegionDecl]) -> SharedWriters:
    """Which rank writes each piece that several ranks hold alike (pure), as DCP's planner dedups
    them: largest first, each to the holder with the fewest bytes to write so far (its own pieces
    counted first), the lowest such rank on a tie. The other holders hash theirs: the replicas are
    compared before anything is published (:func:`~alpha_ckpt.tiers.durable.messages.check_shared`)."""
    # word sizes (a name no region declares counts 1: the coverage check refuses it)
    size = defaultdict(lambda: 1, {r.name: DTYPES[r.dtype][0] for r in regions})
    holders: dict[tuple[str, int, int], list[int]] = {}
    shardable: dict[str, bool] = {}  # a DTensor on every rank that holds a piece of it
    for rank, d in enumerate(descriptors):
        dtensors = set(d.dtensors)
        for name, lo, hi in d.pieces:
            shardable[name] = shardable.get(name, True) and name in dtensors
            if hi > lo:
                holders.setdefault((name, lo, hi), []).append(rank)
    load = [0] * len(descriptors)
    for (name, lo, hi), ranks in holders.items():
        if len(ranks) == 1 or not shardable[name]:
            for rank in ranks:
                load[rank] += (hi - lo) * size[name]
    out: SharedWriters = {}
    for key in sorted((k for k, ranks in holders.items() if len(ranks) > 1 and shardable[k[0]]),
                      key=lambda k: (-(k[2] - k[1]) * size[k[0]], k)):
        writer = min(holders[key], key=lambda r: (load[r], r))
        out[key] = writer
        load[writer] += (key[2] - key[1]) * size[key[0]]
    return out


def saved_layout(descriptors: Sequence[Descriptor], regions: Sequence[RegionDecl],
                 shared: SharedWriters | None = None) -> dict | None:
    """Which rank wrote which words, as a rule a reader computes (pure): None where no rule fits.

    ``partitioned``: regions every rank holds its :func:`~alpha_ckpt.generation.planner.shares` range of;
    ``own``: [ordinal, rank] for a region one rank wrote whole (a PerRank entry, or a replica spread
    to another rank). Everything else is replicated, written by rank 0. A tree restore then reads
    only the group manifests on the paths to the ranks that hold its words. ``shared``: the one
    writer of each piece several ranks hold (:func:`shared_piece_writers`).
    """
    world = len(descriptors)
    replicated = set(descriptors[0].replicated)
    shared = shared or {}
    held: dict[str, list[tuple[int, int, int]]] = {}
    for rank, d in enumerate(descriptors):
        for name, lo, hi in d.pieces:
            if shared.get((name, lo, hi), rank) == rank:
                held.setdefault(name, []).append((rank, lo, hi))
    partitioned, own = [], []
    for region in regions:
        if region.name in replicated:
            writer = [rank for rank, _, _ in held.get(region.name, [])]
            if writer and writer[0] != 0:  # a spread replica: the rank that wrote it
                own.append([region.ordinal, writer[0]])
            continue
        pieces = held.get(region.name, [])
        if [(lo, hi) for _, lo, hi in sorted(pieces)] == shares(region.words, world) and len(pieces) == world:
            partitioned.append(region.ordinal)
        elif len(pieces) == 1 and pieces[0][1:] == (0, region.words):
            own.append([region.ordinal, pieces[0][0]])
        else:
            return None
    return {"rule": "shares", "partitioned": partitioned, "own": own}


def words_held(where: Any, words: int) -> tuple[tuple[int, int, int], ...]:
    """(lo, hi, at) of the region's words a rank holds, by its placement (pure): at is where in the rank's flat tensor."""
    if isinstance(where, tuple) and where[0] in ("ranges", "dtensor"):
        return where[1]
    if isinstance(where, tuple):
        return ((where[0], where[1], 0),)
    return ((0, words, 0),)


def replica_writers(regions: Sequence[RegionDecl], placement: Sequence[Any], world: int) -> dict[str, int]:
    """Which rank writes each replicated region of at least SPREAD_BYTES (pure; the same on every rank
    whose capture agrees): largest first, each to the rank with the fewest replicated bytes so far.
    Smaller ones stay with rank 0, in few shards."""
    load = [0] * world
    out = {}
    replicated = [r for r, where in zip(regions, placement)
                  if where == "replicated" and r.words * DTYPES[r.dtype][0] >= SPREAD_BYTES]
    for region in sorted(replicated, key=lambda r: (-r.words * DTYPES[r.dtype][0], r.name)):
        rank = min(range(world), key=lambda k: (load[k], k))
        out[region.name] = rank
        load[rank] += region.words * DTYPES[region.dtype][0]
    return out
