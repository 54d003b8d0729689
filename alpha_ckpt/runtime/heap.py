"""Python's cyclic garbage collector paused while a save or restore runs.

A save or restore makes a few Python objects per tensor. The collector runs its
full collections by allocation counts and each one scans the whole heap, a
training process's heap included: with 100,000 tensors, collections took more
than half of a save's time. What the paused section leaves as cyclic garbage is
collected once the collector runs again; reference counting frees everything
else as usual.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0            # paused sections open now, on any thread
_resume = False       # whether the collector ran before the first of them


@contextlib.contextmanager
def cyclic_gc_paused():
    """Pause the cyclic collector for the ``with`` block (or a decorated call); sections may nest and
    overlap across threads: the collector runs again, if it ran before, when the last one ends."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
