"""The ref format and the history of a run/step: what a published generation records, and the fence.

    STORE/refs/RUN/STEP/0000000007    one small file per published generation: its root digest

A ref is one canonical JSON line and the BLAKE3 of that line. Its name is the
generation number, :data:`REF_DIGITS` digits wide.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import CapturePrefix, canonical_json, digest_bytes, is_digest, parse_canonical_json
from alpha_ckpt.store.layout import REF_DIGITS, ref_name

REF_NAME_RE = re.compile(r"\A[0-9]{%d}\Z" % REF_DIGITS)
MAX_PUBLISHED_AT = 1e11  # seconds since the epoch: year 5138
MAX_REF_BYTES = 4096


@dataclass(frozen=True)
class RefRecord:
    """One published generation as its ref file records it."""

    run: str
    step: str
    generation: int
    root: str
    root_size: int
    prefix: CapturePrefix
    published_at: float
    bytes: int
    owners: int
    # A memory tier's ref only: the store the generation belongs to and the store's generation it descends
    # from, {"store": instance id, "follows": [generation, root] or None}. Durable refs carry none.
    lineage: dict | None = None


@dataclass(frozen=True)
class UnreadableRef:
    """A ref file that cannot be read as one: its generation number stays taken."""

    run: str
    step: str
    generation: int
    refusal: Refusal
    # True: what lies under the name can never be read as a ref (not a regular file, or content that
    # fails its checks), so gc may set it aside. False: the OS refused to read it (EACCES, EIO), which may pass.
    damaged: bool

    @property
    def name(self) -> str:
        return f"{self.run}/{self.step}/{ref_name(self.generation)}"


@dataclass(frozen=True)
class History:
    """What the refs of one run/step say: the one view of "newest" that every publish's fence,
    ``latest`` (and ``restore("latest")``) and gc share.

    The newest generation is the newest *readable* ref. Unreadable refs are
    passed over (each caller names them), but their numbers stay taken:
    ``top`` is the highest generation number in use, readable or not, and a
    new publish takes ``top + 1``.
    """

    run: str
    step: str
    entries: tuple  # RefRecord | UnreadableRef, oldest first: every ref, or those from the newest readable one up
    top: int        # the highest generation number taken (0: none)

    @property
    def records(self) -> list[RefRecord]:
        return [e for e in self.entries if isinstance(e, RefRecord)]

    @property
    def unreadable(self) -> list[UnreadableRef]:
        return [e for e in self.entries if isinstance(e, UnreadableRef)]

    @property
    def newest(self) -> RefRecord | None:
        """The newest readable generation, or None."""
        return next((e for e in reversed(self.entries) if isinstance(e, RefRecord)), None)

    @property
    def unreadable_above(self) -> list[UnreadableRef]:
        """Unreadable refs newer than the newest readable one, oldest first."""
        newest = self.newest
        return [e for e in self.unreadable if newest is None or e.generation > newest.generation]

    def listing(self) -> list["RefRecord | Refusal"]:
        return [e if isinstance(e, RefRecord) else e.refusal for e in self.entries]


def check_fence(history: History, prefix: CapturePrefix, follows: int | None) -> None:
    """Refuse a publish of ``prefix`` that would fork the history ``history`` (see :class:`History`).

    Against the newest readable generation ("newest"):

    - newest is of a newer epoch: a continuation owns the run/step; this publisher is stale (``stale-epoch``).
    - ``follows`` given (the highest generation number this publisher saw, 0: none) and a number has been
      taken since: refused (``fenced``) when a ref newer than ``follows`` cannot be read (whose it is cannot
      be told), or when newest is of the same epoch and is not generation ``follows`` (another publisher of
      this epoch published meanwhile, or the history lost generation ``follows``).
    - newest is of the same epoch and at this update or a later one (or a later cursor): ``latest``
      would go backwards (``reset-cursor``).

    An unreadable ref is otherwise passed over: it is no generation anyone can resume, and its number stays
    taken. Pure: the caller reads the refs.
    """
    where = f"{prefix.run}/{prefix.step}"
    newest = history.newest
    if newest is not None and newest.prefix.epoch > prefix.epoch:
        p = newest.prefix
        raise Refusal(RefusalCode.STALE_EPOCH, f"publish of update {prefix.update} in epoch {prefix.epoch} fenced: "
                      f"{where} generation {newest.generation} (update {p.update}, root {newest.root}) is of "
                      f"epoch {p.epoch}, a newer continuation that owns this run/step")
    if follows is not None and history.top != follows:
        expected = f"generation {follows}" if follows else "an empty history"
        unknown = [u for u in history.unreadable if u.generation > follows]
        if unknown:
            raise Refusal(RefusalCode.FENCED, f"publish of update {prefix.update} in epoch {prefix.epoch} fenced: "
                          f"{where} took generation {unknown[-1].generation} after {expected}, which this job "
                          f"continues, and it cannot be read, so whether another job published it cannot be "
                          f"told ({unknown[-1].refusal.message}); resume 'latest', which passes over it")
        if newest is None and follows:
            raise Refusal(RefusalCode.FENCED, f"publish of update {prefix.update} fenced: {where} no longer has "
                          f"generation {follows}, which this job continues")
        if newest is not None and newest.prefix.epoch == prefix.epoch:
            p = newest.prefix
            raise Refusal(RefusalCode.FENCED, f"publish of update {prefix.update} in epoch {prefix.epoch} fenced: "
                          f"{where} generation {newest.generation} (update {p.update}, root {newest.root}) was "
                          f"published by another job of the same epoch; this job continues {expected}")
    if newest is None:
        return
    p = newest.prefix
    if p.epoch == prefix.epoch and (prefix.update <= p.update or prefix.cursor < p.cursor):
        raise Refusal(RefusalCode.RESET_CURSOR, f"publish of update {prefix.update} (cursor {prefix.cursor}) in "
                      f"epoch {prefix.epoch} refused: {where} generation {newest.generation} (root {newest.root}) "
                      f"is already at update {p.update} (cursor {p.cursor}) of this epoch, and history only moves "
                      "forward within an epoch (a restart from an older generation continues in a newer epoch)")


def encode_ref(r: RefRecord) -> bytes:
    body = {
        "kind": "ref", "run": r.run, "step": r.step, "generation": r.generation, "root": r.root,
        "root_size": r.root_size, "prefix": r.prefix.to_json(), "published_at": r.published_at,
        "bytes": r.bytes, "owners": r.owners,
    }
    if r.lineage is not None:
        body["lineage"] = r.lineage
    text = canonical_json(body)
    return text + b"\n" + digest_bytes(text).encode("ascii") + b"\n"


def decode_ref(data: bytes, what: str) -> RefRecord:
    """A ref is one canonical JSON line and the BLAKE3 of that line."""
    lines = data.split(b"\n")
    if len(lines) != 3 or lines[2] != b"" or len(lines[1]) != 64:
        raise Refusal(RefusalCode.FORMAT, f"{what}: not a ref file (JSON line, digest line)")
    if digest_bytes(lines[0]).encode("ascii") != lines[1]:
        raise Refusal(RefusalCode.CORRUPT_SHARD, f"{what}: its checksum does not match its content")
    obj = parse_canonical_json(lines[0], what)
    keys = {"kind", "run", "step", "generation", "root", "root_size", "prefix", "published_at", "bytes", "owners"}
    if not isinstance(obj, dict) or set(obj) - {"lineage"} != keys or obj["kind"] != "ref":
        raise Refusal(RefusalCode.FORMAT, f"{what}: unexpected ref fields")
    lineage = obj.get("lineage")
    if lineage is not None and not _is_lineage(lineage):
        raise Refusal(RefusalCode.FORMAT, f"{what}: bad lineage")
    prefix = CapturePrefix.from_json(obj["prefix"], what)
    ints = [obj["generation"], obj["root_size"], obj["bytes"], obj["owners"]]
    published_at = obj["published_at"]
    if not all(type(v) is int and v >= 0 for v in ints) or type(published_at) not in (int, float) \
            or not 0 <= published_at < MAX_PUBLISHED_AT:
        raise Refusal(RefusalCode.FORMAT, f"{what}: bad counters")
    if not is_digest(obj["root"]) or (obj["run"], obj["step"]) != (prefix.run, prefix.step):
        raise Refusal(RefusalCode.FORMAT, f"{what}: bad root digest or run/step")
    return RefRecord(obj["run"], obj["step"], obj["generation"], obj["root"], obj["root_size"], prefix,
                     float(obj["published_at"]), obj["bytes"], obj["owners"], lineage)


def _is_lineage(value: object) -> bool:
    if not isinstance(value, dict) or set(value) != {"store", "follows"} or not isinstance(value["store"], str) \
            or not re.fullmatch(r"[0-9a-f]{1,64}", value["store"]):
        return False
    follows = value["follows"]
    return follows is None or (isinstance(follows, list) and len(follows) == 2 and type(follows[0]) is int
                               and follows[0] >= 0 and is_digest(follows[1]))
