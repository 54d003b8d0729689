"""Exporting a generation's logical state for use outside alpha_ckpt.

    alpha-ckpt export DIGEST --store DIR --to PATH [--format safetensors|torch]

Every region comes out at its full shape under its dotted name
(``model.w1``, ``optim.m.w1``), whatever the publisher (star or tree) and
the owner count: the restore planner assembles each region from its slices.
Nothing is written unless every slice read validated (the same
validate-then-copy path as a restore), and the file is published through
:func:`alpha_ckpt.store.durable.durable_commit` in the destination's own
directory: a crash leaves either no file or the complete one, and an
existing file is never replaced.

``torch`` output is a ``torch.save`` pickle of a flat dict of tensors, for
users to ``torch.load(..., weights_only=True)``; alpha_ckpt itself never reads
it back.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from alpha_ckpt.store.durable import durable_commit
from alpha_ckpt.errors import Refusal, RefusalCode, StoreUsageError
from alpha_ckpt.format.records import DTYPES, RegionDecl
from alpha_ckpt.state.manifest import torch_dtype
from alpha_ckpt.generation.planner import WantedSlice
from alpha_ckpt.generation.reader import Generation, PreparedRestore, open_generation, payload_bytes
from alpha_ckpt.store import Store, write_all

FORMATS = ("safetensors", "torch")
_TORCH_SUFFIXES = (".pt", ".pth")
_WRITE_CHUNK = 16 << 20  # progress granularity of the write


def format_for(path: str | os.PathLike, fmt: str | None = None) -> str:
    """The explicit format, else ``torch`` for a .pt/.pth path, else ``safetensors``."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise StoreUsageError(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")
        return fmt
    return "torch" if os.fspath(path).lower().endswith(_TORCH_SUFFIXES) else "safetensors"


@dataclass(frozen=True)
class ExportResult:
    path: str
    format: str
    bytes: int            # size of the written file
    validated_bytes: int  # stored bytes read from the store and validated
    root: str
    regions: tuple[RegionDecl, ...]

    def to_json(self) -> dict:
        return {"root": self.root, "digest": self.root, "path": self.path, "format": self.format, "bytes": self.bytes,
                "validated_bytes": self.validated_bytes,
                "regions": [{"name": r.name, "dtype": r.dtype, "shape": list(r.shape)} for r in self.regions]}


def export_bytes(generation: Generation) -> int:
    """Bytes an export reads (stored, validated) plus the tensor bytes it writes: a progress bar's total."""
    return payload_bytes(generation) + sum(r.words * DTYPES[r.dtype][0] for r in generation.manifest.regions)


class _CountingWriter:
    """A file wrapper that reports each write to ``advance`` (torch.save writes in pieces)."""

    def __init__(self, f, advance: Callable[[int], None]):
        self._f, self._advance = f, advance

    def write(self, data) -> int:
        n = self._f.write(data)
        self._advance(len(memoryview(data).cast("B")))
        return n

    def flush(self) -> None:
        self._f.flush()


def _check_unique_names(regions: tuple[RegionDecl, ...], root: str) -> None:
    # The format does not require unique region names (identity is the ordinal), but the export keys by name.
    first: dict[str, int] = {}
    for r in regions:
        if r.name in first:
            raise Refusal(RefusalCode.FORMAT, f"generation {root[:16]}...: regions {first[r.name]} and {r.ordinal} "
                          f"are both named {r.name!r}; exported by name, one would be lost")
        first[r.name] = r.ordinal


def check_destination(path: str | os.PathLike) -> tuple[str, str, str]:
    """(absolute path, its directory, its name); refuses a path that exists or has no directory."""
    full = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(full)
    if not name:
        raise StoreUsageError(f"export destination {os.fspath(path)!r} names a directory, not a file")
    if os.path.lexists(full):  # a dangling symlink counts: never write through or over one
        raise StoreUsageError(f"export destination {full!r} already exists; export never overwrites a file")
    if not os.path.isdir(directory):
        raise StoreUsageError(f"export destination directory {directory!r} does not exist")
    return full, directory, name


def export_generation(store: Store | str | os.PathLike, root: str, path: str | os.PathLike, fmt: str | None = None, *,
                      advance: Callable[[int], None] | None = None) -> ExportResult:
    """Validate generation ``root`` and write its logical state to ``path`` (a new file).

    ``fmt`` is ``safetensors`` or ``torch`` (default: by the suffix, see
    :func:`format_for`). Raises :class:`~alpha_ckpt.Refusal` (no file
    written) when anything read is wrong, and
    :class:`~alpha_ckpt.errors.StoreUsageError` when ``path`` exists or its
    directory does not.
    """
    fmt = format_for(path, fmt)
    check_destination(path)  # before opening anything: a taken path is a usage error, not a refusal
    owned = not isinstance(store, Store)
    s = Store(store, create=False) if owned else store
    try:
        with open_generation(s, root) as generation:
            return export_opened(generation, path, fmt, advance=advance)
    finally:
        if owned:
            s.close()


def export_opened(generation: Generation, path: str | os.PathLike, fmt: str | None = None, *,
                  advance: Callable[[int], None] | None = None) -> ExportResult:
    """:func:`export_generation` for a generation opened with every shard (``open_generation(store, root)``).

    ``advance(n)`` is told the stored bytes validated, then the bytes
    written; together they add up to about :func:`export_bytes`.
    """
    fmt = format_for(path, fmt)
    full, directory, name = check_destination(path)
    regions = generation.manifest.regions
    _check_unique_names(regions, generation.root)
    prepared = PreparedRestore(generation, [WantedSlice(r.ordinal, 0, r.words, r.ordinal) for r in regions],
                               advance=advance)
    validated = prepared.bytes_read  # before copy_into releases the validated views
    # Allocated only once every slice validated: a refusal costs no destination memory.
    tensors = [torch.empty(r.shape, dtype=torch_dtype(r.dtype)) for r in regions]
    prepared.copy_into([t.reshape(-1).view(torch.uint8) for t in tensors])
    state = {r.name: t for r, t in zip(regions, tensors)}
    if isinstance(generation.manifest.metadata, dict) and "dcp" in generation.manifest.metadata:
        from alpha_ckpt.generation.dcp_metadata import DCP_KEY, logical_tensors  # a DCP checkpoint: its chunks make whole tensors
        state = logical_tensors(generation.manifest.metadata[DCP_KEY], regions, tensors)
        regions = tuple(RegionDecl(i, name, next(k for k, v in DTYPES.items() if torch_dtype(k) == t.dtype),
                                   tuple(t.shape)) for i, (name, t) in enumerate(state.items()))
    p = generation.prefix
    written = [0]
    report = advance or (lambda n: None)

    def write(fd: int) -> None:
        if fmt == "safetensors":
            from safetensors.torch import save as safetensors_save
            metadata = {"run": p.run, "step": p.step, "update": str(p.update), "cursor": str(p.cursor),
                        "epoch": str(p.epoch), "root": generation.root}
            data = memoryview(safetensors_save(state, metadata=metadata))
            for start in range(0, len(data), _WRITE_CHUNK):
                write_all(fd, data[start:start + _WRITE_CHUNK])
                report(min(_WRITE_CHUNK, len(data) - start))
        else:
            # closefd=False: durable_commit owns the descriptor (fsync, close); closing the wrapper flushes it.
            with open(fd, "wb", closefd=False) as f:
                torch.save(state, _CountingWriter(f, report))
        written[0] = os.fstat(fd).st_size

    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # The temporary file lives beside the destination, so the final rename never crosses file systems.
        durable_commit(tmp_dir=dir_fd, dest_dir=dir_fd, write=write, name=name, kind="export")
    except FileExistsError:
        raise StoreUsageError(f"export destination {full!r} appeared while exporting; it was left as it is") from None
    finally:
        os.close(dir_fd)
    return ExportResult(full, fmt, written[0], validated, generation.root, regions)
