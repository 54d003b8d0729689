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
:func:`alpha_ckpt.gc.apply_gc`); a pin that finds its ref aside puts it back.
Otherwise (the ref or an object is gone) the pin is withdrawn and refused.
"""
from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from typing import Callable

from . import durable
from .durable import entry_exists, file_kind
from .errors import Refusal, RefusalCode
from .format import canonical_json, check_name, is_digest, parse_canonical_json
from .restore import open_generation, verify_generation
from .store import Store, write_all
from .store.layout import PINS, REFS, TMP, ref_name

PINS_DIR = PINS
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
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


def _not_a_directory(exc: OSError) -> Exception:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return Refusal(RefusalCode.FORMAT, f"store entry {PINS_DIR} is a symlink or not a directory")
    return exc


def _open_pins_dir(store: Store) -> int | None:
    """The pins directory (never through a symlink), or None where there is none."""
    try:
        return store.layout.open_dir(PINS_DIR)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _not_a_directory(exc) from None


def pinned_roots(store: Store, on_hostile: Callable[[str, str], None] | None = None) -> set[str]:
    """The roots pinned: every digest-named entry of STORE/pins (its content is not needed).

    An entry that is not a regular file is no pin file, but its name still
    pins (gc errs on keeping); ``on_hostile(path, why)`` hears of it.
    """
    dir_fd = _open_pins_dir(store)
    if dir_fd is None:
        return set()
    try:
        roots = set()
        for name in os.listdir(dir_fd):
            if not is_digest(name):
                continue
            roots.add(name)
            if on_hostile is not None:
                try:
                    mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(mode):
                    on_hostile(f"{PINS_DIR}/{name}", f"a {file_kind(mode)}, not a pin file (its root stays pinned)")
        return roots
    finally:
        os.close(dir_fd)


def read_pin(store: Store, root: str) -> Pin | Refusal | None:
    """The pin of ``root``: its record, a refusal where the file is damaged, or None where it is not pinned."""
    store.check_digest(root)
    dir_fd = _open_pins_dir(store)
    if dir_fd is None:
        return None
    try:
        try:
            fd = os.open(root, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return Refusal(RefusalCode.FORMAT, f"pin {root}: cannot open ({exc.strerror})")
    finally:
        os.close(dir_fd)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # a FIFO or a directory: never read (it could block or fail)
            return Refusal(RefusalCode.FORMAT, f"pin {root}: a {file_kind(mode)}, not a pin file")
        data = os.pread(fd, MAX_PIN_BYTES + 1, 0)
    finally:
        os.close(fd)
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


def _pins_dir(store: Store) -> tuple[int, int]:
    """(the root's fd, the pins directory's fd), the pins directory made durable if new."""
    root_fd = store.layout.open_root()
    try:
        return root_fd, durable.make_dir_durable(root_fd, PINS_DIR)
    except OSError as exc:
        os.close(root_fd)
        raise _not_a_directory(exc) from None
    except BaseException:
        os.close(root_fd)
        raise


def _refuse_unless_pin_file(pins_fd: int, root: str, doing: str) -> None:
    """Only a regular file is a pin file of ours: anything else under a pin's name is left as it is."""
    try:
        mode = os.stat(root, dir_fd=pins_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise Refusal(RefusalCode.FORMAT, f"{PINS_DIR}/{root} is a {file_kind(mode)}, not a pin file: it is left as "
                      f"it is, and the generation cannot be {doing} until it is removed by hand")


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
        tmp_fd = os.open(TMP, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        try:
            if isinstance(existing, Refusal):
                _refuse_unless_pin_file(pins_fd, root, "pinned")
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
            _keep_ref(store, record)
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


def _keep_ref(store: Store, record) -> None:
    """Make sure the pinned generation's ref is still in place, once the pin file is durable.

    A gc that planned to drop it renames it aside in its directory, reads the
    pins again, and puts back what is pinned by then. A pin that finds its ref
    aside puts it back itself (gc then finds it gone and leaves it); one whose
    ref gc removed already is refused (the caller withdraws the pin)."""
    name = ref_name(record.generation)
    where = f"{record.run}/{record.step}"
    try:
        dir_fd = store.layout.open_dir(REFS, record.run, record.step)
    except FileNotFoundError:
        dir_fd = None
    except OSError as exc:
        raise Refusal(RefusalCode.FORMAT, f"refs/{where} is a symlink or not a directory") from exc
    if dir_fd is not None:
        try:
            if entry_exists(dir_fd, name):
                return
            for aside in sorted(n for n in os.listdir(dir_fd) if n.startswith(f"aside-{name}-")):
                try:
                    durable.rename_noreplace(dir_fd, aside, dir_fd, name)
                    os.fsync(dir_fd)
                    return
                except FileExistsError:  # put back meanwhile
                    return
                except FileNotFoundError:  # put back or removed meanwhile
                    continue
            if entry_exists(dir_fd, name):  # a gc put it back after the first look
                return
        finally:
            os.close(dir_fd)
    raise Refusal(RefusalCode.MISSING_SHARD, f"generation {record.root} ({where} generation {record.generation}) "
                  "was removed by gc while it was being pinned")


def unpin_generation(store: Store, root: str) -> bool:
    """Remove the pin of ``root`` (unlink, then fsync the directory). False where it was not pinned."""
    store.check_digest(root)
    root_fd, pins_fd = _pins_dir(store)
    try:
        _refuse_unless_pin_file(pins_fd, root, "unpinned")
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
