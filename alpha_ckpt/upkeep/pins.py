"""Pins: generations a user keeps whatever the retention.

    STORE/pins/<root digest>    canonical JSON: root, run, step, generation, pinned_at, note

gc keeps a pinned generation (every ref naming its root, and every object
it reaches) regardless of ``--keep`` and ``--completed-steps``; pinned
generations do not count toward ``--keep``. The pin's name is what protects:
an unreadable pin file still pins the root it is named after.

Only a published, fully valid generation can be pinned. The pin is written
first, then every object of the generation is touched, the whole generation
verified and its ref checked to be in place: a gc that planned before the pin
existed sees the touched objects as young and puts them back, and reads the
pins again before it removes a ref, which it first renames aside (see
:func:`alpha_ckpt.upkeep.gc.apply_gc`); a pin that finds its ref aside puts it back.
Otherwise (the ref or an object is gone) the pin is withdrawn and refused.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from alpha_ckpt.errors import Refusal, RefusalCode
from alpha_ckpt.format.records import canonical_json, check_name, parse_canonical_json
from alpha_ckpt.generation.reader import open_generation, verify_generation
from alpha_ckpt.store import Store
from alpha_ckpt.store.layout import PINS
from alpha_ckpt.store import pinfiles, sweep


def _files(store: Store):
    """Where ``store`` keeps its pins (and rescues a ref a gc set aside): its file system, or its object store."""
    if store.layout is None:
        from alpha_ckpt.store import s3_sweep
        return s3_sweep, s3_sweep.rescue_ref
    return pinfiles, sweep.rescue_ref

PINS_DIR = PINS
MAX_PIN_BYTES = 8192
MAX_NOTE_CHARS = 1000


@dataclass(frozen=True)
class Pin:
    root: str
    run: str
    step: str
    generation: int
    pinned_at: float
    note: str

    def to_json(self) -> dict:
        return {"root": self.root, "run": self.run, "step": self.step, "generation": self.generation,
                "pinned_at": self.pinned_at, "note": self.note}

    def to_bytes(self) -> bytes:
        return canonical_json({"kind": "pin", **self.to_json()}) + b"\n"

    @classmethod
    def from_bytes(cls, root: str, data: bytes) -> "Pin":
        what = f"pin {root}"
        if len(data) > MAX_PIN_BYTES or not data.endswith(b"\n"):
            raise Refusal(RefusalCode.FORMAT, f"{what}: not one JSON line of at most {MAX_PIN_BYTES} bytes")
        obj = parse_canonical_json(data[:-1], what)
        keys = {"kind", "root", "run", "step", "generation", "pinned_at", "note"}
        if not isinstance(obj, dict) or set(obj) != keys or obj["kind"] != "pin" or obj["root"] != root:
            raise Refusal(RefusalCode.FORMAT, f"{what}: unexpected pin fields or another root")
        check_name(obj["run"], "run")
        check_name(obj["step"], "step")
        if type(obj["generation"]) is not int or type(obj["pinned_at"]) not in (int, float) \
                or not isinstance(obj["note"], str):
            raise Refusal(RefusalCode.FORMAT, f"{what}: bad generation, time or note")
        return cls(root, obj["run"], obj["step"], obj["generation"], float(obj["pinned_at"]), obj["note"])


def pinned_roots(store: Store, on_hostile: Callable[[str, str], None] | None = None) -> set[str]:
    """The roots pinned: every digest-named entry of STORE/pins (its content is not needed).

    An entry that is not a regular file is no pin file, but its name still
    pins (gc errs on keeping); ``on_hostile(path, why)`` hears of it.
    """
    return _files(store)[0].pin_names(store, on_hostile)


def read_pin(store: Store, root: str) -> Pin | Refusal | None:
    """The pin of ``root``: its record, a refusal where the file is damaged, or None where it is not pinned."""
    store.check_digest(root)
    data = _files(store)[0].read_pin_file(store, root, MAX_PIN_BYTES)
    if data is None or isinstance(data, Refusal):
        return data
    try:
        return Pin.from_bytes(root, data)
    except Refusal as refusal:
        return refusal


def list_pins(store: Store, on_hostile: Callable[[str, str], None] | None = None) -> list[Pin | tuple[str, Refusal]]:
    out: list[Pin | tuple[str, Refusal]] = []
    for root in sorted(pinned_roots(store, on_hostile)):
        pin = read_pin(store, root)
        if pin is not None:
            out.append(pin if isinstance(pin, Pin) else (root, pin))
    return out


def pin_generation(store: Store, root: str, note: str = "") -> tuple[Pin, bool]:
    """Pin a published, fully valid generation. Returns (its pin, whether it is new); Refusal otherwise."""
    store.check_digest(root)
    if len(note) > MAX_NOTE_CHARS:
        raise ValueError(f"a pin's note holds at most {MAX_NOTE_CHARS} characters")
    existing = read_pin(store, root)
    if isinstance(existing, Pin):
        return existing, False
    record = store.find_ref(root)
    if record is None:
        raise Refusal(RefusalCode.MISSING_SHARD, f"{root} is not a published generation: no ref names it")
    pin = Pin(root, record.run, record.step, record.generation, time.time(), note)
    body = pin.to_bytes()
    with _files(store)[0].PinFiles(store, commits=True) as pins:
        if isinstance(existing, Refusal):
            pins.refuse_unless_pin_file(root, "pinned")
            pins.remove(root)  # a damaged pin file: written anew below
        try:
            pins.commit(root, body)
        except FileExistsError:  # pinned meanwhile by someone else
            again = read_pin(store, root)
            if isinstance(again, Pin):
                return again, False
            raise Refusal(RefusalCode.FORMAT, f"pin {root}: a damaged pin file appeared meanwhile") from None
        try:
            _touch_generation(store, root, record)
            verify_generation(store, root)
            _keep_ref(store, record)
        except BaseException:
            pins.remove(root)
            raise
    return pin, True


def _touch_generation(store: Store, root: str, record) -> None:
    """Renew every object of the generation: a gc that planned before the pin existed then spares them."""
    with open_generation(store, root, record, wanted=[]) as generation:
        digests = [m.digest for m in generation.manifests] + [s.digest for m in generation.manifests for s in m.shards]
    for digest in digests:
        if not store.renew_object(digest):
            raise Refusal(RefusalCode.MISSING_SHARD, f"object {digest} of generation {root} is missing from the store")


def _keep_ref(store: Store, record) -> None:
    """Make sure the pinned generation's ref is still in place, once the pin file is durable.

    A gc that planned to drop it renames it aside in its directory, reads the
    pins again, and puts back what is pinned by then. A pin that finds its ref
    aside puts it back itself (gc then finds it gone and leaves it); one whose
    ref gc removed already is refused (the caller withdraws the pin)."""
    if not _files(store)[1](store, record.run, record.step, record.generation):
        raise Refusal(RefusalCode.MISSING_SHARD, f"generation {record.root} ({record.run}/{record.step} generation "
                      f"{record.generation}) was removed by gc while it was being pinned")


def unpin_generation(store: Store, root: str) -> bool:
    """Remove the pin of ``root`` (unlink, then fsync the directory). False where it was not pinned."""
    store.check_digest(root)
    with _files(store)[0].PinFiles(store) as pins:
        pins.refuse_unless_pin_file(root, "unpinned")
        return pins.remove(root)
