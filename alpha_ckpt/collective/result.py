"""What :meth:`Checkpointer.save <alpha_ckpt.Checkpointer.save>` returns, in every mode: a :class:`SaveResult`.

* sync: a completed result; ``.root`` is the root digest, durable on return.
* async: ``.root`` (or ``.result()``) waits until the background publish is durable and
  raises its failure; ``.done()`` says whether it is; ``.wait_snapshot()`` is the fence
  of ``defer_snapshot=True``.
* skipped (``in_flight="skip"`` while a save was in flight, on every rank): ``.skipped``
  is True, ``.root`` None.

For one release a sync result is also the root digest as a ``str`` (it compares equal to
it), as ``save`` returned before; new code reads ``.root``.
"""
from __future__ import annotations

from typing import Any


class SaveResult:
    """One save of a Checkpointer (see the module docstring)."""

    def __init__(self, *, root: str | None = None, handle: Any = None, skipped: bool = False,
                 stats: dict | None = None):
        self._root, self._handle, self.skipped = root, handle, skipped
        self._stats = stats if stats is not None else {}

    @property
    def root(self) -> str | None:
        """The root digest, once durable (async: waits, and raises the save's failure); None when skipped."""
        return self.result()

    def result(self, timeout: float | None = None) -> str | None:
        """The root digest (async: waits up to ``timeout`` seconds, raises the save's failure); None when skipped."""
        if self._handle is not None:
            return self._handle.result(timeout)
        return self._root

    def done(self) -> bool:
        """Whether the save is over (published or failed); a sync or skipped save always is."""
        return self._handle.done() if self._handle is not None else True

    def wait_snapshot(self) -> None:
        """Async with ``defer_snapshot=True``: return once the tensors are copied (a no-op otherwise)."""
        if self._handle is not None:
            self._handle.wait_snapshot()

    @property
    def stats(self) -> dict:
        """What the publish wrote: root, update, generation, bytes, bytes_written, seconds (once done)."""
        return self._stats

    @property
    def stall_s(self) -> float:
        """Seconds the caller was blocked by this save (sync: the whole save)."""
        return self._handle.stall_s if self._handle is not None else float(self._stats.get("seconds", 0.0))

    @property
    def save_s(self) -> float:
        """Seconds from the call to the durable result."""
        return self._handle.save_s if self._handle is not None else float(self._stats.get("seconds", 0.0))

    def __repr__(self) -> str:
        if self.skipped:
            return "SaveResult(skipped)"
        if not self.done():
            return "SaveResult(in flight)"
        return f"SaveResult(root={self._root!r})" if self._handle is None else "SaveResult(done)"


class _SyncResult(str, SaveResult):
    """A completed sync save; also its root digest as a ``str``, as ``save`` returned before (one release)."""

    def __new__(cls, root: str, stats: dict):
        obj = super().__new__(cls, root)
        SaveResult.__init__(obj, root=root, stats=stats)
        return obj

    def __init__(self, root: str, stats: dict):  # noqa: D107 - initialized in __new__
        pass

    __repr__ = SaveResult.__repr__


def completed(root: str, stats: dict) -> SaveResult:
    return _SyncResult(root, stats)
