"""A StatefulDataLoader whose worker processes make random transforms: resumed bit for bit through the
Checkpointer when its dataset is an alpha_ckpt.WorkerRNGDataset, and a warning at save when it is not."""
import random
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import alpha_ckpt
from alpha_ckpt import Checkpointer, UsageError, WorkerRNGDataset, WorkerRNGWarning
from ranks import run_ranks

STEPS, STOP = 20, 5  # 12 batches an epoch: stopped mid-epoch, resumed into the next epochs


class RandomlyAugmented(Dataset):
    """Each sample carries draws from torch's, NumPy's and Python's generators of the process that makes it."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, torch.rand(()).item(), np.random.rand(), random.random()], dtype=torch.float64)


class Counting(Dataset):
    """A dataset with its own state, kept beside the worker generators by the wrapper."""

    def __init__(self):
        self.served = 0

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        self.served += 1
        return index

    def state_dict(self) -> dict:
        return {"served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.served = state["served"]


def _loader(dataset, persistent_workers=False):
    return StatefulDataLoader(dataset, batch_size=2, shuffle=True, num_workers=2,
                              persistent_workers=persistent_workers)


def train(rank, world, store, persistent_workers, resume, stop=None):
    """Batches (and a main-process draw per step) to STEPS, or saved at ``stop`` and stopped there."""
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    if resume:
        torch.manual_seed(999), random.seed(999), np.random.seed(999)  # a new process: other states until restored
    loader = _loader(WorkerRNGDataset(RandomlyAugmented()), persistent_workers)
    state = {"data": loader, "rng": alpha_ckpt.RNGState()}
    ckpt = Checkpointer(store, run="loader")
    counters = ckpt.restore(state, root="latest" if resume else None)
    done = counters.update if resume else 0
    seen = []
    while done < STEPS:
        for batch in loader:  # the rest of the interrupted epoch first, then epochs as the script makes them
            seen.append((batch.tolist(), torch.rand(()).item()))
            done += 1
            if done == stop:
                ckpt.save(state, update=done)
                ckpt.close()
                return seen
            if done == STEPS:
                break
    ckpt.close()
    return seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize("persistent_workers", [False, True])
def test_random_transforms_in_two_workers_resume_bit_identical_to_a_run_that_never_stopped(tmp_path,
                                                                                             persistent_workers):
    straight = run_ranks(1, train, str(tmp_path / "straight"), persistent_workers, False, tmp=tmp_path,
                         timeout=240)[0]
    before = run_ranks(1, train, str(tmp_path / "s"), persistent_workers, False, STOP, tmp=tmp_path, timeout=240)[0]
    after = run_ranks(1, train, str(tmp_path / "s"), persistent_workers, True, tmp=tmp_path, timeout=240)[0]
    assert len(before) == STOP and len(straight) == STEPS
    assert before + after == straight


def save_twice(rank, world, store, wrapped, num_workers, in_order=True):
    data = RandomlyAugmented()
    loader = StatefulDataLoader(WorkerRNGDataset(data) if wrapped else data, batch_size=2, num_workers=num_workers,
                                in_order=in_order)
    state = {"data": loader}
    ckpt = Checkpointer(store, run="warn")
    ckpt.restore(state, root=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = iter(loader)
        for update in (1, 2):
            next(batches)
            ckpt.save(state, update=update)
    ckpt.close()
    return [w.category.__name__ for w in caught if issubclass(w.category, WorkerRNGWarning)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("wrapped, in_order", [(False, True), (True, False)])
def test_saving_a_loader_whose_workers_generators_its_state_lacks_warns_once_per_loader(tmp_path, wrapped, in_order):
    # Unwrapped, the workers' generators are not saved; out of order, which worker draws for which batch varies.
    got = run_ranks(1, save_twice, str(tmp_path / "s"), wrapped, 2, in_order, tmp=tmp_path)[0]
    assert got == ["WorkerRNGWarning"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("wrapped, num_workers", [(True, 2), (False, 0)])
def test_saving_a_loader_over_a_worker_rng_dataset_or_without_workers_does_not_warn(tmp_path, wrapped, num_workers):
    assert run_ranks(1, save_twice, str(tmp_path / "s"), wrapped, num_workers, tmp=tmp_path)[0] == []


def test_the_worker_rng_dataset_keeps_the_wrapped_datasets_own_state_and_no_generators_in_the_main_process():
    counting = Counting()
    dataset = WorkerRNGDataset(counting)
    assert [dataset[i] for i in range(3)] == [0, 1, 2] and len(dataset) == 8
    state = random.getstate()
    assert dataset.state_dict() == {"dataset": {"served": 3}}  # the main generators are RNGState's
    random.seed(5)
    dataset.load_state_dict({"dataset": {"served": 1}})
    assert counting.served == 1 and random.getstate() != state


def test_an_iterable_dataset_is_refused_by_the_worker_rng_dataset():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(UsageError):
        WorkerRNGDataset(Stream())
