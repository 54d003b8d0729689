"""The learner and the oracle: keyed data, shares, partitioned == replicated, resume through the store."""
import json
from pathlib import Path

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.testing import oracle
from alpha_ckpt.testing import launch
from alpha_ckpt.job.learner.config import JobConfig, load_config
from alpha_ckpt.job.learner.data import sample, sequence_indices, shares
from alpha_ckpt.job.learner.digest import state_digest
from alpha_ckpt.job.learner.model import LearnerState, apply_update, configure_determinism, share_gradient

CONFIG = Path(__file__).parents[2] / "configs" / "forecast.toml"
SMALL = dict(stores=4, items=6, hidden=8, batch=10)


@pytest.mark.parametrize("total, owners", [(10, 3), (96, 8), (5, 8), (7, 1), (0, 2)])
def test_shares_are_contiguous_larger_first_and_differ_by_at_most_one(total, owners):
    parts = shares(total, owners)
    assert len(parts) == owners and parts[0][0] == 0 and parts[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
    sizes = [hi - lo for lo, hi in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_samples_are_keyed_by_seed_and_index_not_by_order():
    config = JobConfig(**SMALL)
    late = sample(config, 17)
    for i in range(5):
        sample(config, i)
    again = sample(config, 17)
    assert torch.equal(late[0], again[0]) and torch.equal(late[1], again[1])
    other_seed = sample(JobConfig(**SMALL, seed=1), 17)
    assert not torch.equal(late[0], other_seed[0])


def test_the_input_sequence_visits_every_sample_once_per_pass():
    config = JobConfig(**SMALL)
    n = config.samples
    assert sorted(sequence_indices(config, 0, n)) == list(range(n))
    assert sorted(sequence_indices(config, n, 2 * n)) == list(range(n))
    assert sequence_indices(config, 0, n) != sequence_indices(config, n, 2 * n)


def _owned_ranges(state: LearnerState, owners: int, r: int) -> dict:
    return {n: shares(p.numel(), owners)[r] for n, p in state.params.items()}


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_partitioned_updates_give_the_bits_of_replicated_updates(optimizer):
    configure_determinism()
    config = JobConfig(**SMALL, optimizer=optimizer)
    replicated = LearnerState.initial(config)
    owners = 3
    partitioned = [LearnerState.initial(config) for _ in range(owners)]
    for _ in range(3):
        grads, loss = share_gradient(config, replicated.params, replicated.cursor, replicated.cursor + config.batch)
        apply_update(config, replicated, grads, loss)
        for r, s in enumerate(partitioned):
            apply_update(config, s, grads, loss, ranges=_owned_ranges(s, owners, r))
        # the all-gather: every owner takes each range from its owner
        for name in replicated.params:
            for r, s in enumerate(partitioned):
                lo, hi = _owned_ranges(s, owners, r)[name]
                for other in partitioned:
                    other.params[name].view(-1)[lo:hi] = s.params[name].view(-1)[lo:hi]
    for name, p in replicated.params.items():
        assert torch.equal(p, partitioned[0].params[name]), name


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_three_updates_a_checkpoint_and_two_more_equal_five_uninterrupted(tmp_path, optimizer):
    config = JobConfig(**SMALL, optimizer=optimizer)
    straight = oracle.run(config, 5, oracle.parse_placements("2", 5))
    first = oracle.run(config, 3, oracle.parse_placements("2", 3))
    root = alpha_ckpt.save(first.tensors(), store=tmp_path, run=config.run, step=config.step, update=first.update,
                           cursor=first.cursor, epoch=0)
    resumed = LearnerState.initial(config)
    counters = alpha_ckpt.restore(resumed.tensors(), store=tmp_path, root=root)
    resumed.update, resumed.cursor = counters.update, counters.cursor
    resumed = oracle.run(config, 5, oracle.parse_placements("2", 5), resumed)
    assert state_digest(resumed.tensors(), resumed.update, resumed.cursor) == \
        state_digest(straight.tensors(), straight.update, straight.cursor)
    assert resumed.metrics["samples"].item() == 5 * config.batch  # nothing counted twice


def test_placements_parse_into_one_owner_count_per_update():
    assert oracle.parse_placements("4:3,3:2", 5) == [4, 4, 4, 3, 3]
    assert oracle.parse_placements("4:3,3:2", 7) == [4, 4, 4, 3, 3, 3, 3]
    assert oracle.parse_placements(None, 2) == [1, 1]
    with pytest.raises(ValueError):
        oracle.parse_placements("x:1", 2)


def test_set_overrides_keys_with_their_types_and_refuses_unknown_keys():
    config = load_config(str(CONFIG), ["optimizer=sgd", "lr=0.5", "batch=12"])
    assert (config.optimizer, config.lr, config.batch) == ("sgd", 0.5, 12)
    with pytest.raises(ValueError):
        load_config(str(CONFIG), ["no_such_key=1"])
    with pytest.raises(ValueError):
        load_config(str(CONFIG), ["optimizer=rmsprop"])


@pytest.mark.timeout(120)
def test_oracle_command_prints_the_final_json_line_and_is_repeatable():
    cmd = ["alpha_ckpt.testing.oracle", CONFIG, "--updates", "2", "--placements", "3:1,2:1", "--set", "batch=12",
           "--set", "hidden=8"]
    first, second = (launch.python_m(*cmd, timeout=100) for _ in range(2))
    assert first.returncode == 0, first.stderr
    result = json.loads(first.stdout)
    assert set(result) == {"state_digest", "last_generation", "update", "cursor", "epoch", "owners", "output"}
    assert (result["update"], result["cursor"], result["owners"]) == (2, 24, 2)
    assert first.stdout == second.stdout
