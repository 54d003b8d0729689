"""What :meth:`Checkpointer.save <alpha_ckpt.Checkpointer.save>` returns, in every mode: a :class:`SaveResult`.

* sync: a completed result; ``.root`` is the root digest, durable on return.
* async: ``.root`` (or ``.result()``) waits until the background publish is durable and
  raises its failure; ``.done()`` says whether it is; ``.wait_snapshot()`` is the fence
  of ``defer_snapshot=True``.
* skipped (``in_flight="skip"`` while a save was in flight, on every rank): ``.skipped``
  is True, ``.root`` None.

Copied or pickled (``deepcopy``, ``torch.save`` of a dict holding it, a worker's return
value), a result is its root digest as a plain ``str`` (async: once durable; it waits), so a
script that keeps it in its own checkpoint reads it back with ``torch.load(weights_only=True)``
and no alpha_ckpt; ``.stats`` and the timings stay with the original. A skipped save has no
root to keep: pickling it is a ``TypeError``.
"""
from __future__ import annotations

import codecs
from types import MappingProxyType
from typing import Any, Mapping


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
    def stats(self) -> Mapping[str, Any]:
        """What the publish wrote, read-only: root, update, generation, bytes, bytes_written, seconds, phases
        (once done; see :attr:`Checkpointer.last_save <alpha_ckpt.Checkpointer.last_save>`)."""
        return MappingProxyType(self._stats)

    @property
    def phases(self) -> Mapping[str, float]:
        """This rank's seconds in each phase of the save (capture, agree, ``durable.write``, ...), once done:
        where a save's time goes, without timing anything from outside."""
        return MappingProxyType(self._stats.get("phases", {}))

    @property
    def stall_s(self) -> float:
        """Seconds the caller was blocked by this save (sync: the whole save)."""
        return self._handle.stall_s if self._handle is not None else float(self._stats.get("seconds", 0.0))

    @property
    def save_s(self) -> float:
        """Seconds from the call to the durable result."""
        return self._handle.save_s if self._handle is not None else float(self._stats.get("seconds", 0.0))

    def __reduce__(self):
        root = self.root
        if root is None:
            raise TypeError("a skipped save has no root digest to copy or pickle")
        return _plain_str(str.__str__(root))

    def __repr__(self) -> str:
        if self.skipped:
            return "SaveResult(skipped)"
        if not self.done():
            return "SaveResult(in flight)"
        return f"SaveResult(root={self._root!r})" if self._handle is None else "SaveResult(done)"


def _plain_str(text: str) -> tuple:
    """A pickle reduction that rebuilds ``text`` as a plain ``str``.

    A ``str`` subclass cannot be pickled as a plain string, and ``torch.load(weights_only=True)``
    calls no function off its short allowlist (not even ``str``). ``_codecs.encode`` is on it (it is
    how pickle spells bytes), and rot13 is the one codec that maps a ``str`` to a ``str``: the text
    travels rot13'd and comes back as itself, in any unpickler.
    """
    return codecs.encode, (codecs.encode(text, "rot13"), "rot13")


def completed(root: str, stats: dict) -> SaveResult:
    return SaveResult(root=root, stats=stats)
