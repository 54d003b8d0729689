"""Opening a generation: the root manifest, the tree's path to the roles read, and every shard head
they name, each checked (name, size, digest, format, capture prefix, schema, word ranges) and the
coverage of every region on word ranges. No payload byte is read here (:mod:`alpha_ckpt.generation.payloads`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from alpha_ckpt.format.decoding import decode_head, parse_manifest_header, parse_shard_header, split_head
from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import CapturePrefix, ChildRef, ManifestHead, ShardHead, ShardRef
from alpha_ckpt.state.manifest import check_root_manifest, check_shard_against_record
from alpha_ckpt.generation.planner import Hierarchy, SavedSlice, WantedSlice
from alpha_ckpt.store import ObjectFile, RefRecord, Store
from alpha_ckpt.store.backend import check_opened_size

_HEAD_READ = 64 << 10  # the first read of an object: its whole head, for all but the largest


def read_head(obj: ObjectFile, what: str, size_is_known: bool) -> tuple[Any, int]:
    """An object's decoded header and head length, checked against its name (and its size, when known)."""
    first = obj.read_at(0, min(obj.size, _HEAD_READ))
    head_len = split_head(first, obj.size, what, size_is_known=size_is_known)
    head = first if head_len <= len(first) else obj.read_at(0, head_len)
    header = decode_head(head, obj.digest, obj.size, what, size_is_known=size_is_known)
    return header, head_len


def _find_ref(store: Store, root: str, manifest: ManifestHead | None, what: str) -> tuple[RefRecord | None, ManifestHead | None]:
    """The ref naming ``root`` (None if none does), and its manifest where read on the way. An intact
    manifest names its run/step, whose history holds its ref: no listing of the store. A manifest that
    does not read is left to be read again once the ref is found among every run's, and refused as it
    then is (its record's size known)."""
    store.check_digest(root)
    if manifest is None or manifest.digest != root:
        try:
            manifest, size = _read_manifest_sized(store, root, None, what)
        except Refusal:
            return store.find_ref(root), None
    else:
        size = manifest.size
    ref = store.find_ref(root, near=(manifest.prefix.run, manifest.prefix.step)) or store.find_ref(root)
    if ref is not None and ref.root_size != size:
        return ref, None  # read again with the size its record gives, and refused as that read refuses
    return ref, manifest


class Generation:
    """An opened generation whose manifest and shard heads are validated (payloads not yet)."""

    def __init__(self, store: Store, root: str, ref: RefRecord | None, manifest: ManifestHead,
                 shards: dict[str, tuple[ObjectFile, ShardHead]], manifests: tuple[ManifestHead, ...] = ()):
        self.store, self.root, self.ref, self.manifest, self.shards = store, root, ref, manifest, shards
        self.manifests = manifests or (manifest,)  # every manifest read: the root first

    @property
    def prefix(self) -> CapturePrefix:
        return self.manifest.prefix

    def close(self) -> None:
        for obj, _ in self.shards.values():
            obj.close()
        self.shards = {}

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def saved_slices(self) -> list[SavedSlice]:
        return [SavedSlice(s.ordinal, s.lo, s.hi, digest, i)
                for digest, (_, head) in self.shards.items() for i, s in enumerate(head.slices)]


def _read_manifest(store: Store, digest: str, size: int | None, what: str) -> ManifestHead:
    return _read_manifest_sized(store, digest, size, what)[0]


def _read_manifest_sized(store: Store, digest: str, size: int | None, what: str) -> tuple[ManifestHead, int]:
    """The manifest ``digest`` (of ``size`` bytes where known), and its object's size."""
    with store.open_object(digest, what) as obj:
        check_opened_size(obj, size, what)
        header, head_len = read_head(obj, what, size_is_known=size is not None)
        object_size = obj.size
    if header.get("kind") != "manifest":
        raise Refusal(RefusalCode.FORMAT, f"{what} is a {header.get('kind')}, not a manifest")
    return parse_manifest_header(header, digest, head_len, what), object_size


def _check_group(group: ManifestHead, record: ChildRef, root: ManifestHead, hierarchy: Hierarchy, what: str) -> None:
    """A child group manifest against its parent's record, the root, and the hierarchy's shape."""
    p = group.publisher
    if p.kind != "tree" or p.fanout != hierarchy.fanout or group.owners != hierarchy.owners:
        raise Refusal(RefusalCode.COVERAGE, f"{what} is not a group manifest of this tree "
                      f"({hierarchy.owners} owners, fan-out {hierarchy.fanout})")
    if (p.role, p.subtree) != (record.role, record.size):
        raise Refusal(RefusalCode.COVERAGE, f"{what} is role {p.role} with {p.subtree} roles; its parent's record "
                      f"says role {record.role} with {record.size}")
    if group.prefix != root.prefix or group.schema_digest != root.schema_digest:
        raise Refusal(RefusalCode.MIXED_CAPTURE, f"{what} captured {group.prefix}, the root {root.prefix}")
    _check_children_prescribed(group, hierarchy, what)


def _check_children_prescribed(group: ManifestHead, hierarchy: Hierarchy, what: str) -> None:
    below = group.publisher.subtree - 1
    if len(group.children) != min(hierarchy.fanout, below):  # before building the prescription: bounded work
        raise Refusal(RefusalCode.COVERAGE, f"{what} records {len(group.children)} children, the hierarchy prescribes "
                      f"{min(hierarchy.fanout, below)}")
    prescribed = hierarchy.children(group.publisher.role, group.publisher.subtree)
    if [(c.role, c.size) for c in group.children] != prescribed:
        raise Refusal(RefusalCode.COVERAGE, f"{what} records children {[(c.role, c.size) for c in group.children]}, "
                      f"the hierarchy prescribes {prescribed}")


def _tree_manifests(store: Store, root: ManifestHead, roles: Sequence[int] | None) -> list[ManifestHead]:
    """The root, then every group manifest (roles None) or those on the paths down to ``roles``."""
    p = root.publisher
    hierarchy = Hierarchy(root.owners, p.fanout)
    if (p.role, p.subtree) != (0, root.owners):
        raise Refusal(RefusalCode.COVERAGE, f"root manifest is role {p.role} with {p.subtree} roles, "
                      f"not the root of {root.owners}")
    _check_children_prescribed(root, hierarchy, "root manifest")
    if roles is not None and any(not 0 <= r < root.owners for r in roles):
        raise Refusal(RefusalCode.COVERAGE, f"the tree has roles [0, {root.owners}), not all of {sorted(roles)}")
    out, pending = [root], [root]
    while pending:
        parent = pending.pop()
        for record in parent.children:
            if roles is not None and not any(record.role <= r < record.role + record.size for r in roles):
                continue  # never a subtree holding none of the roles wanted
            what = f"group manifest of role {record.role} ({record.digest[:16]}...)"
            group = _read_manifest(store, record.digest, record.bytes, what)
            _check_group(group, record, root, hierarchy, what)
            out.append(group)
            pending.append(group)
    return sorted(out, key=lambda g: g.publisher.role)  # preorder: the root first, a path top-down


def _holds_any(record: ShardRef, wanted: Mapping[int, Sequence[tuple[int, int]]]) -> bool:
    """Whether the record holds a word of ``wanted`` ((lo, hi) ranges by ordinal: each slice looks
    only at its own region's ranges, never at every wanted slice)."""
    return any(lo < w_hi and w_lo < hi and hi > lo
               for (o, lo, hi) in record.slices for w_lo, w_hi in wanted.get(o, ()))


def records_holding(records: Sequence[ShardRef], wanted: Sequence[WantedSlice]) -> list[ShardRef]:
    """The shard records that hold a word of ``wanted``, in order."""
    by_ordinal: dict[int, list[tuple[int, int]]] = {}
    for w in wanted:
        by_ordinal.setdefault(w.ordinal, []).append((w.lo, w.hi))
    return [r for r in records if _holds_any(r, by_ordinal)]


@dataclass(frozen=True)
class Opening:
    """What :func:`open_generation` opens, found before any shard is: the root manifest (and its ref), the
    manifests read on the way (the root first), the shard records to open, and every record of those
    manifests (coverage is checked on them)."""
    root: str
    ref: RefRecord | None
    manifest: ManifestHead
    groups: tuple[ManifestHead, ...]
    records: tuple[ShardRef, ...]
    every_record: tuple[ShardRef, ...]
    targets: tuple[int, ...] | None

    def objects(self) -> list[tuple[str, int]]:
        """The shards to open, as (name, size)."""
        return [(record.digest, record.size) for record in self.records]


def open_generation(store: Store, root: str, ref: RefRecord | None = None, *,
                    role: int | Sequence[int] | Callable[[ManifestHead], Sequence[int]] | None = None,
                    wanted: Sequence[WantedSlice] | None = None, manifest: ManifestHead | None = None) -> Generation:
    """Validate the root manifest and the shard heads it leads to; check coverage.

    For a tree, ``role=None`` reads every group manifest (verification);
    ``role=r`` reads only the height + 1 manifests from the root down to role
    r, and opens r's own shards and the root's (which hold the replicated
    words): a restore never touches a sibling subtree. ``role=[r, s, ...]``
    reads the union of those paths (a repartitioned restore); a callable
    picks them from the root manifest. Coverage of a
    path is structural (each parent checked its children's roles and subtree
    sizes); a wanted word that is not on the paths is refused when planned.
    With ``wanted``, only the shards whose records hold a wanted word are
    opened (star or tree); coverage is still checked on every record read.
    ``manifest``: the root manifest as the caller already read and validated it (it is not read again).
    """
    return open_planned(store, plan_opening(store, root, ref, role=role, wanted=wanted, manifest=manifest))


def plan_opening(store: Store, root: str, ref: RefRecord | None = None, *,
                 role: int | Sequence[int] | Callable[[ManifestHead], Sequence[int]] | None = None,
                 wanted: Sequence[WantedSlice] | None = None, manifest: ManifestHead | None = None) -> Opening:
    """The first half of :func:`open_generation` (same arguments): the manifests read and checked, the shards
    to open chosen; no shard is opened."""
    what = f"root manifest {root[:16]}..."
    if ref is None:
        ref, manifest = _find_ref(store, root, manifest, what)
    if manifest is None or manifest.digest != root:  # ``manifest``: this root's, read and validated by the caller
        manifest = _read_manifest(store, root, ref.root_size if ref else None, what)
    if ref is not None and ref.prefix != manifest.prefix:
        raise Refusal(RefusalCode.MIXED_CAPTURE, f"{what}: ref {ref.run}/{ref.step}/{ref.generation} records another capture prefix")
    if callable(role):  # the roles to read may depend on what the root manifest says
        role = role(manifest) if manifest.publisher.kind == "tree" else None
    targets = [role] if isinstance(role, int) else (None if role is None else sorted(set(role)))
    if manifest.publisher.kind == "tree":
        groups = _tree_manifests(store, manifest, targets)
        chosen = groups if targets is None else [g for g in groups if g.publisher.role in set(targets) | {0}]
        records = list({r.digest: r for g in chosen for r in g.shards}.values())  # the root may be a target too
    else:
        groups, records = [manifest], list(manifest.shards)
    every_record = records
    if wanted is not None:
        records = records_holding(records, wanted)
    named: set[str] = set()
    for record in records:
        if record.digest in named:
            raise Refusal(RefusalCode.COVERAGE, f"shard {record.digest[:16]}... is named twice by the manifest")
        if record.digest == root:
            raise Refusal(RefusalCode.FORMAT, f"{what} names itself as a shard")
        named.add(record.digest)
    return Opening(root, ref, manifest, tuple(groups), tuple(records), tuple(every_record),
                   None if targets is None else tuple(targets))


def open_planned(store: Store, opening: Opening,
                 open_objects: Callable[[list[tuple[str, int]], str], list[ObjectFile]] | None = None) -> Generation:
    """The second half of :func:`open_generation`: open the shards ``opening`` chose (through ``open_objects``,
    default the store's), check each head against its record, and the coverage."""
    root, manifest, records, targets = opening.root, opening.manifest, opening.records, opening.targets
    what = f"root manifest {root[:16]}..."
    opened = (open_objects or store.open_objects)(opening.objects(), "shard")
    shards: dict[str, tuple[ObjectFile, ShardHead]] = {}
    try:
        for record, obj in zip(records, opened):
            w = f"shard {record.digest[:16]}..."
            header, head_len = read_head(obj, w, size_is_known=True)
            head = parse_shard_header(header, record.digest, head_len, w)
            check_shard_against_record(head, record, manifest.prefix, manifest.schema_digest, manifest.regions, w)
            shards[record.digest] = (obj, head)
        # The one validator publishers run before their ref (a path of a tree is covered structurally).
        check_root_manifest(manifest, list(opening.every_record) if targets is None or manifest.publisher.kind == "star"
                            else None, what)
        if isinstance(manifest.metadata, dict) and "dcp" in manifest.metadata:
            # a DCP checkpoint: its Metadata must tile its tensors by its regions (imported here: torch's
            # DCP package takes about a second to import, and most generations are not DCP's)
            from alpha_ckpt.generation.dcp_metadata import check_generation
            check_generation(manifest)
    except BaseException:
        for obj in opened:
            obj.close()
        raise
    return Generation(store, root, opening.ref, manifest, shards, opening.groups)
