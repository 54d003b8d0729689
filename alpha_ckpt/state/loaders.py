"""Objects whose ``load_state_dict()`` defers work that draws from the global generators.

torchdata's ``StatefulDataLoader.load_state_dict`` only keeps the state; the next ``iter(loader)``
makes the iterator from it, and making a loader iterator draws a seed from torch's generator
(``loader.generator``, the global one by default). In the uninterrupted run that draw happened at
the start of the epoch, before the saved generator state; in a resumed run it would come after
``RNGState`` was restored, one draw more than the uninterrupted run made. The iterator made from
the loaded state takes that seed from the state where it matters (worker processes) and not at
all with ``num_workers=0``, so the draw is kept off the global generator: a resumed run's
generators are exactly the restored ones, whatever the order of the state's entries and whenever
the script makes the iterator (after ``sampler.set_epoch``, as in the uninterrupted run).
"""
from __future__ import annotations

from typing import Any

import torch


def settle_lazy_load(obj: Any) -> None:
    """After ``obj.load_state_dict()``: a loader holding a state for its next iterator makes that
    iterator, when the script asks for it, without drawing from torch's global generator."""
    if getattr(obj, "next_iter_state", None) is None:
        return  # nothing deferred
    make = getattr(obj, "_get_iterator", None)
    if not callable(make) or getattr(make, "_alpha_ckpt_settled", False):
        return

    def make_from_loaded_state() -> Any:
        if getattr(obj, "next_iter_state", None) is None:  # a later epoch's iterator draws as usual
            _unhook()
            return make()
        with torch.random.fork_rng(devices=[]):  # torch's CPU generator as restored, after the draw
            iterator = make()
        _unhook()
        return iterator

    def _unhook() -> None:
        if obj.__dict__.get("_get_iterator") is make_from_loaded_state:
            del obj.__dict__["_get_iterator"]

    make_from_loaded_state._alpha_ckpt_settled = True
    obj._get_iterator = make_from_loaded_state
