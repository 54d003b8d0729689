"""Where everything lies under a store's root: the one module that knows the directory layout.

    STORE/objects/ab/abcdef...                 shards and manifests, named by the BLAKE3 of their head,
                                               in fan-out directories named by the digest's first two hex digits
    STORE/refs/RUN/STEP/0000000007             one small file per published generation: its root digest
    STORE/tmp/                                 in-flight writes (and what gc sets aside while it removes)
    STORE/pending/<pid>-<random>               leases of publishes in flight (:mod:`alpha_ckpt.store.leases`)
    STORE/quarantine/<digest>-<time>-<random>  damaged or hostile entries found at an object's path, set aside
    STORE/quarantine/ref-<generation>-<time>-<random>   unreadable refs gc set aside
    STORE/pins/<root>                          pinned generations (:mod:`alpha_ckpt.upkeep.pins`)
    STORE/verified/<root>                      what a completeness check validated (:mod:`alpha_ckpt.upkeep.complete`)
    STORE/outputs/RUN/STEP/<name>              a job's declared outputs
    STORE/instance                             this store's instance id (random, written once at its first
                                               writable open): what the memory tier ties its generations to

Every other module asks a :class:`StoreLayout` (``store.layout``) for a path or a
directory descriptor; none joins names onto a store's root itself. Names are
relative to the root (for ``dir_fd``-relative calls) or absolute paths; the root
is the user's path and may be a symlink, nothing below it may be one.
"""
from __future__ import annotations

import os
import re

OBJECTS = "objects"
REFS = "refs"
TMP = "tmp"
OUTPUTS = "outputs"
PENDING = "pending"
QUARANTINE = "quarantine"
PINS = "pins"
VERIFIED = "verified"
INSTANCE = "instance"
# Made (durably) when a store is created; the others appear on first use.
CREATED = (OBJECTS, REFS, TMP, OUTPUTS, PENDING)

REF_DIGITS = 10  # a ref's name: its generation number, zero-padded to this width
FAN_DIGITS = 2   # an object's fan-out directory: the first hex digits of its digest

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


# What gc names what it sets aside, and what it sweeps.
ASIDE_PREFIX = "aside-"  # tmp/aside-<digest>-<pid>-<random>: an object being removed, set aside first
# refs/RUN/STEP/aside-<generation>-<pid>-<random>: a ref being removed, set aside in its own directory first
REF_ASIDE_RE = re.compile(r"\Aaside-([0-9]{%d})-[0-9]+-[0-9a-f]{8}\Z" % REF_DIGITS)
OUTPUT_SUFFIX = ".safetensors"
# <digest>-<unix time>-<random> (an object's entry), ref-<generation>-<unix time>-<random> (a ref)
QUARANTINED_RE = re.compile(r"\A(?:[0-9a-f]{64}|ref-[0-9]{%d})-([0-9]{1,12})-[0-9a-f]{8}\Z" % REF_DIGITS)


def quarantined_names(names, before: float, skip) -> list[str]:
    """Of the entries of quarantine/, those set aside before ``before`` (by the time in their names), in
    order; ``skip(path, why)`` hears of a name no save gives."""
    out = []
    for name in sorted(names):
        match = QUARANTINED_RE.match(name)
        if match is None:
            skip(f"{QUARANTINE}/{name}", "not a name a save gives to what it sets aside")
        elif int(match.group(1)) < before:
            out.append(name)
    return out


def ref_name(generation: int) -> str:
    """The file name of generation ``generation``'s ref."""
    return f"{generation:0{REF_DIGITS}d}"


def fan_of(digest: str) -> str:
    """The fan-out directory an object named ``digest`` lies in."""
    return digest[:FAN_DIGITS]


class StoreLayout:
    """The paths of one store rooted at ``root``."""

    def __init__(self, root: str | os.PathLike):
        self.root = os.fspath(root)

    def path(self, *names: str) -> str:
        """The absolute-or-as-given path of ``names`` under the root."""
        return os.path.join(self.root, *names)

    def open_root(self) -> int:
        """A descriptor of the root directory (followed if the root is a symlink: it is the user's path)."""
        return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def open_dir(self, *names: str) -> int:
        """A descriptor of a directory under the root, never through a symlink (OSError as os.open raises it)."""
        return os.open(self.path(*names), DIR_FLAGS)

    # Directories, as absolute paths.
    def objects_dir(self) -> str:
        return self.path(OBJECTS)

    def fan_dir(self, digest_or_fan: str) -> str:
        return self.path(OBJECTS, fan_of(digest_or_fan))

    def object_path(self, digest: str) -> str:
        return self.path(OBJECTS, fan_of(digest), digest)

    def refs_dir(self, run: str | None = None, step: str | None = None) -> str:
        return self.path(REFS, *[n for n in (run, step) if n is not None])

    def ref_path(self, run: str, step: str, generation: int) -> str:
        return self.path(REFS, run, step, ref_name(generation))

    def tmp_dir(self) -> str:
        return self.path(TMP)

    def pending_dir(self) -> str:
        return self.path(PENDING)

    def quarantine_dir(self) -> str:
        return self.path(QUARANTINE)

    def pins_dir(self) -> str:
        return self.path(PINS)

    def verified_dir(self) -> str:
        return self.path(VERIFIED)

    def outputs_dir(self, run: str | None = None, step: str | None = None) -> str:
        return self.path(OUTPUTS, *[n for n in (run, step) if n is not None])

    def output_path(self, run: str, step: str, name: str) -> str:
        return self.path(OUTPUTS, run, step, name)
