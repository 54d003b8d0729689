"""Pins: generations a user keeps whatever the retention.

    STORE/pins/<root digest>    canonical JSON: root, run, step, generation, pinned_at, note

gc keeps a pinned generation (every ref naming its root, and every object
it reaches) regardless of ``--keep`` and ``--completed-steps``; pinned
generations do not count toward ``--keep``. The pin's name is what protects:
an unreadable pin file still pins the root it is named after.

Only a published, fully valid generation can be pinned. The pin is written
first, then every object of the generation is touched and the whole
generation verified: a gc that planned before the pin existed sees the
touched objects as young and puts them back (see :func:`alpha_ckpt.gc.apply_gc`),
or the verification fails and the pin is withdrawn.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from . import durable
from .errors import Refusal, RefusalCode
from .format import canonical_json, check_name, is_digest, parse_canonical_json
from .restore import open_generation, verify_generation
from .store import Store, write_all

PINS_DIR = "pins"
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


def pinned_roots(store: Store) -> set[str]:
    """The roots pinned: every digest-named entry of STORE/pins (its content is not needed)."""
    try:
        return {name for name in os.listdir(os.path.join(store.root, PINS_DIR)) if is_digest(name)}
    except FileNotFoundError:
        return set()


def read_pin(store: Store, root: str) -> Pin | Refusal | None:
    """The pin of ``root``: its record, a refusal where the file is damaged, or None where it is not pinned."""
    store.check_digest(root)
    path = os.path.join(store.root, PINS_DIR, root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Refusal(RefusalCode.FORMAT, f"pin {root}: cannot open ({exc.strerror})")
    try:
        data = os.pread(fd, MAX_PIN_BYTES + 1, 0)
    finally:
        os.close(fd)
    try:
        return Pin.from_bytes(root, data)
    except Refusal as refusal:
        return refusal


def list_pins(store: Store) -> list[Pin | tuple[str, Refusal]]:
    out: list[Pin | tuple[str, Refusal]] = []
    for root in sorted(pinned_roots(store)):
        pin = read_pin(store, root)
        if pin is not None:
            out.append(pin if isinstance(pin, Pin) else (root, pin))
    return out


def _pins_dir(store: Store) -> tuple[int, int]:
    """(store root fd, pins dir fd), the pins directory made durable if new."""
    root_fd = os.open(store.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return root_fd, durable.make_dir_durable(root_fd, PINS_DIR)
    except BaseException:
        os.close(root_fd)
        raise


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
    root_fd, pins_fd = _pins_dir(store)
    try:
        tmp_fd = os.open("tmp", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        try:
            if isinstance(existing, Refusal):
                _unlink_durably(pins_fd, root)  # a damaged pin file: written anew below
            try:
                durable.durable_commit(tmp_dir=tmp_fd, dest_dir=pins_fd, write=lambda fd: write_all(fd, body),
                                       name=root, kind="pin")
            except FileExistsError:  # pinned meanwhile by someone else
                again = read_pin(store, root)
                if isinstance(again, Pin):
                    return again, False
                raise Refusal(RefusalCode.FORMAT, f"pin {root}: a damaged pin file appeared meanwhile") from None
        finally:
            os.close(tmp_fd)
        try:
            _touch_generation(store, root, record)
            verify_generation(store, root)
        except BaseException:
            _unlink_durably(pins_fd, root)
            raise
    finally:
        os.close(pins_fd)
        os.close(root_fd)
    return pin, True


def _touch_generation(store: Store, root: str, record) -> None:
    """Renew every object of the generation: a gc that planned before the pin existed then spares them."""
    with open_generation(store, root, record, wanted=[]) as generation:
        digests = [m.digest for m in generation.manifests] + [s.digest for m in generation.manifests for s in m.shards]
    for digest in digests:
        if not store.renew_object(digest):
            raise Refusal(RefusalCode.MISSING_SHARD, f"object {digest} of generation {root} is missing from the store")


def unpin_generation(store: Store, root: str) -> bool:
    """Remove the pin of ``root`` (unlink, then fsync the directory). False where it was not pinned."""
    store.check_digest(root)
    root_fd, pins_fd = _pins_dir(store)
    try:
        return _unlink_durably(pins_fd, root)
    finally:
        os.close(pins_fd)
        os.close(root_fd)


def _unlink_durably(dir_fd: int, name: str) -> bool:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    os.fsync(dir_fd)
    return True
