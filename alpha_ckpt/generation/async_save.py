"""Asynchronous save: a real snapshot at the update boundary, the durable publish in the background.

    saver = AsyncSaver(in_flight="wait")
    handle = saver.submit(tensors, publish)      # publish(snapshot_tensors) runs on the saver's thread
    ...                                          # training goes on
    handle.result()                              # the publish's result, or its exception

The snapshot is a copy into host buffers that the saver owns and reuses from
one save to the next (fresh memory would cost page faults at every save). It
is a copy, never a view: a value changed after the boundary must not reach
the checkpoint (DCP's async_save once persisted such values).

Two ways to take it:

* ``defer_snapshot=False`` (the default): :meth:`AsyncSaver.submit` returns
  once the copy is done, so the caller may change its tensors at once.
* ``defer_snapshot=True``: the copy is made on the saver's thread and
  ``submit`` returns at once. The caller must call
  :meth:`SaveHandle.wait_snapshot` before it changes any of the tensors
  (training does: between the boundary and the next optimizer step there is
  a whole forward and backward pass for the copy to hide behind).

At most one save is in flight. At the next boundary, ``in_flight="wait"``
blocks until the previous save is durable; ``"skip"`` returns None and
counts the skip (the caller logs the reason). A failed save is never
swallowed: its exception is raised by the next ``submit`` or by ``drain``.

The stall the caller paid for a save (waiting for the previous one, the
copy, waiting at the snapshot fence) is in :attr:`SaveHandle.stall_s`.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from alpha_ckpt.generation.writer import ShardCarry

IN_FLIGHT_POLICIES = ("wait", "skip")


class SaveHandle:
    """One save: its snapshot fence, its result and what the caller paid for it."""

    def __init__(self) -> None:
        self._snapshot = threading.Event()
        self._snapshot_error: BaseException | None = None
        self._future: Future = Future()
        self.stall_s = 0.0          # seconds the caller was blocked by this save
        self.waited_s = 0.0         # of which: waiting for the previous save to finish
        self.snapshot_s = 0.0       # seconds the copy itself took (on whichever thread made it)
        self.save_s = 0.0           # seconds from the boundary to the durable result
        self.started = time.monotonic()

    def wait_snapshot(self) -> None:
        """Block until the snapshot is taken; the caller may change its tensors afterwards."""
        if not self._snapshot.is_set():
            t0 = time.monotonic()
            self._snapshot.wait()
            self.stall_s += time.monotonic() - t0
        if self._snapshot_error is not None:
            raise self._snapshot_error

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        """What the publish returned, once it is durable (or its failure, raised): for
        :func:`alpha_ckpt.save_async`, the :class:`~alpha_ckpt.generation.writer.Published` generation, whose
        ``.root`` is the root digest :func:`alpha_ckpt.save` would have returned."""
        return self._future.result(timeout)

    @property
    def root(self) -> str:
        """The root digest, once durable (waits, and raises the save's failure), as every save result
        of alpha_ckpt has it (:class:`~alpha_ckpt.collective.result.SaveResult` too)."""
        published = self.result()
        return published if isinstance(published, str) else published.root


class AsyncSaver:
    """Snapshots into reused host buffers and runs one publish at a time on a background thread."""

    def __init__(self, *, in_flight: str = "wait") -> None:
        if in_flight not in IN_FLIGHT_POLICIES:
            raise ValueError(f"in_flight must be one of {', '.join(IN_FLIGHT_POLICIES)}, not {in_flight!r}")
        self.in_flight = in_flight
        self.skipped = 0
        self._buffers: list[torch.Tensor] = []
        self._pending: SaveHandle | None = None
        self.carry = ShardCarry()  # what this saver's publishes wrote: unchanged regions are carried, not rewritten
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alpha-ckpt-save")

    @property
    def pending(self) -> SaveHandle | None:
        return self._pending

    def busy(self) -> bool:
        return self._pending is not None and not self._pending.done()

    def submit(self, tensors: Sequence[torch.Tensor], publish: Callable[[list[torch.Tensor]], Any], *,
               defer_snapshot: bool = False) -> SaveHandle | None:
        """Snapshot ``tensors`` and run ``publish(snapshot)`` in the background; None if skipped."""
        t0 = time.monotonic()
        previous = self._pending
        if previous is not None and not previous.done() and self.in_flight == "skip":
            self.skipped += 1
            return None
        if previous is not None:
            self._pending = None
            previous.result()  # waits under "wait"; raises the previous save's failure either way
        handle = SaveHandle()
        handle.started = t0
        handle.waited_s = time.monotonic() - t0
        sources = [t.detach() for t in tensors]
        if not defer_snapshot:
            self._take_snapshot(handle, sources)
            handle.wait_snapshot()
        self._pending = handle
        self._executor.submit(self._run, handle, sources, publish, defer_snapshot)
        handle.stall_s += time.monotonic() - t0
        return handle

    def drain(self) -> SaveHandle | None:
        """Wait for the save in flight (if any); raise its failure. Returns its handle."""
        handle, self._pending = self._pending, None
        if handle is not None:
            handle.result()
        return handle

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------ internals

    def _take_snapshot(self, handle: SaveHandle, sources: Sequence[torch.Tensor]) -> None:
        t0 = time.monotonic()
        try:
            if len(self._buffers) != len(sources):
                self._buffers = [None] * len(sources)  # type: ignore[list-item]
            needs_sync = False
            for i, src in enumerate(sources):
                buf = self._buffers[i]
                if buf is None or buf.dtype != src.dtype or buf.shape != src.shape:
                    # Pinned host memory lets a device-to-host copy run without a staging bounce.
                    buf = torch.empty(src.shape, dtype=src.dtype, device="cpu",
                                      pin_memory=src.device.type == "cuda")
                    self._buffers[i] = buf
                buf.copy_(src, non_blocking=src.device.type == "cuda")
                needs_sync |= src.device.type == "cuda"
            if needs_sync:
                torch.cuda.synchronize()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller at its fence
            handle._snapshot_error = exc
        handle.snapshot_s = time.monotonic() - t0
        handle._snapshot.set()

    def _run(self, handle: SaveHandle, sources: Sequence[torch.Tensor], publish: Callable, deferred: bool) -> None:
        if deferred:
            self._take_snapshot(handle, sources)
        if handle._snapshot_error is not None:
            handle._future.set_exception(handle._snapshot_error)
            return
        try:
            value = publish(list(self._buffers))
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            handle.save_s = time.monotonic() - handle.started
            handle._future.set_exception(exc)
            return
        handle.save_s = time.monotonic() - handle.started
        handle._future.set_result(value)
