"""Data loaders resumed with every generator as the run that never stopped had it.

The late seed draw. torchdata's ``StatefulDataLoader.load_state_dict`` only keeps the state; the next ``iter(loader)``
makes the iterator from it, and making a loader iterator draws a seed from torch's generator
(``loader.generator``, the global one by default). In the uninterrupted run that draw happened at
the start of the epoch, before the saved generator state; in a resumed run it would come after
``RNGState`` was restored, one draw more than the uninterrupted run made. The iterator made from
the loaded state takes that seed from the state where it matters (worker processes) and not at
all with ``num_workers=0``, so the draw is kept off the global generator: a resumed run's
generators are exactly the restored ones, whatever the order of the state's entries and whenever
the script makes the iterator (after ``sampler.set_epoch``, as in the uninterrupted run).

The workers' generators. Worker processes are seeded afresh whenever they start, a resumed run's
too, so random transforms in them resume only if the dataset's state (which torchdata takes and
loads inside each worker) holds the worker's generators: :class:`WorkerRNGDataset`. A save of a
loader with workers whose dataset is not one warns (:class:`~alpha_ckpt.errors.WorkerRNGWarning`).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Mapping

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from alpha_ckpt.errors import UsageError, WorkerRNGWarning
from alpha_ckpt.state.rng import cpu_generators_state, set_cpu_generators_state


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


class WorkerRNGDataset(Dataset):
    """A map-style dataset whose state, taken in a data loader's worker process, holds that worker's
    Python ``random``, NumPy and torch CPU generators, so that random transforms resume bit for bit.

    ``StatefulDataLoader(alpha_ckpt.WorkerRNGDataset(dataset), num_workers=N, ...)``: torchdata calls
    ``state_dict()`` in each worker after every batch it makes and keeps, per worker, the state of the
    last batch the loader yielded; a restored loader starts its workers, seeds them, then calls
    ``load_state_dict()`` in each, so every worker draws on from where it stood. In the main process
    (``num_workers=0``) the dataset draws from the main generators, which ``RNGState`` holds, and its
    state holds none. The wrapped dataset's own ``state_dict()``, if it has one, is kept beside.
    """

    def __init__(self, dataset: Any):
        if isinstance(dataset, IterableDataset):
            # An iterable dataset's iterator is made after its state is loaded, and may draw: not covered.
            raise UsageError("WorkerRNGDataset wraps a map-style dataset (__getitem__), not an IterableDataset")
        self.dataset = dataset
        if getattr(dataset, "__getitems__", None):  # batched fetch, as torch's fetcher would call it unwrapped
            self.__getitems__ = dataset.__getitems__

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if get_worker_info() is not None:
            state["worker_generators"] = cpu_generators_state()
        if _is_stateful(self.dataset):
            state["dataset"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "dataset" in state:
            self.dataset.load_state_dict(state["dataset"])
        if "worker_generators" in state and get_worker_info() is not None:
            set_cpu_generators_state(state["worker_generators"])


_warned_loaders: "weakref.WeakSet[Any]" = weakref.WeakSet()


def warn_if_worker_generators_unsaved(obj: Any) -> None:
    """At capture: a loader whose workers draw from generators its state lacks warns, once per loader."""
    if not isinstance(obj, torch.utils.data.DataLoader) or not getattr(obj, "num_workers", 0):
        return
    if obj in _warned_loaders:
        return
    if not isinstance(obj.dataset, WorkerRNGDataset):
        why = "its state does not hold the worker processes' generators (wrap its dataset in WorkerRNGDataset)"
    elif not getattr(obj, "in_order", True):
        why = "with in_order=False which worker makes which batch is not repeatable"
    else:
        return
    _warned_loaders.add(obj)
    warnings.warn(f"{type(obj).__name__} with num_workers={obj.num_workers}: {why}, so random transforms in its "
                  "workers do not resume bit for bit", WorkerRNGWarning)


def _is_stateful(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))
