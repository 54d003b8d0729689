"""The manifest tree in one process: hierarchy shape, commitment checks, publication, path restore."""
import math
import os

import pytest
from hypothesis import given, settings, strategies as st

from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.format.records import CapturePrefix, ChildRef
from alpha_ckpt.generation.planner import Hierarchy
from alpha_ckpt.testing import simulate
from alpha_ckpt.tiers.durable.tree import Commitment, check_commitment
from alpha_ckpt.generation.reader import open_generation, verify_generation
from alpha_ckpt.store import Store
from alpha_ckpt.testing.forge import publish_ref_unfenced
from alpha_ckpt.generation.writer import write_manifest


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 400), st.integers(1, 20))
def test_every_subtree_is_the_preorder_range_its_children_tile(owners, fanout):
    h = Hierarchy(owners, fanout)
    seen = [0]
    for role in range(owners):
        size = h.subtree(role)
        kids = h.children(role, size)
        assert len(kids) == min(fanout, size - 1)
        start = role + 1
        for child, child_size in kids:
            assert child == start and h.subtree(child) == child_size and h.parent(child) == role
            start += child_size
        assert start == role + size
        sizes = [n for _, n in kids]
        assert sizes == sorted(sizes, reverse=True) and (not sizes or sizes[0] - sizes[-1] <= 1)
        seen.extend(c for c, _ in kids)
    assert sorted(seen) == list(range(owners))  # every role has exactly one parent (the root none)
    if fanout >= 2:
        assert h.height() <= math.ceil(math.log(owners, fanout)) + 1 if owners > 1 else h.height() == 0


PREFIX = CapturePrefix("r", "s", 3, 12, 1)
RECORD = ChildRef(5, 4, "a" * 64, 640)


def test_a_commitment_with_the_prescribed_role_size_prefix_and_replicas_is_accepted():
    assert check_commitment(Commitment(PREFIX, RECORD, "x", 1), role=5, size=4, prefix=PREFIX, replicas="x") == RECORD


@pytest.mark.parametrize("commitment, code", [
    (Commitment(CapturePrefix("r", "s", 4, 12, 1), RECORD, "x", 1), RefusalCode.MIXED_CAPTURE),
    (Commitment(CapturePrefix("r", "s", 3, 12, 2), RECORD, "x", 1), RefusalCode.MIXED_CAPTURE),
    (Commitment(PREFIX, ChildRef(6, 4, "a" * 64, 640), "x", 1), RefusalCode.COVERAGE),
    (Commitment(PREFIX, ChildRef(5, 5, "a" * 64, 640), "x", 1), RefusalCode.COVERAGE),
    (Commitment(PREFIX, RECORD, "y", 1), RefusalCode.MIXED_CAPTURE),
], ids=["other-update", "other-epoch", "wrong-role", "one-role-too-many", "diverged-replica"])
def test_a_parent_refuses_a_commitment_the_hierarchy_does_not_prescribe(commitment, code):
    with pytest.raises(Refusal) as info:
        check_commitment(commitment, role=5, size=4, prefix=PREFIX, replicas="x")
    assert info.value.code == code


@pytest.mark.parametrize("owners, fanout", [(1, 8), (4, 2), (4, 3), (7, 2), (7, 3), (40, 3)])
def test_a_published_tree_verifies_and_each_role_reads_only_its_path(tmp_path, owners, fanout):
    store = Store(tmp_path / "store")
    report, completions = simulate.publish(store, owners, fanout)
    assert report.root and all(c["ok"] and c["root"] == report.root for c in completions)
    verify_generation(store, report.root)
    h = Hierarchy(owners, fanout)
    ref = store.list_refs("sim", "fit")[0]
    for role in range(owners):
        before = store.objects_opened
        with open_generation(store, report.root, ref, role=role) as generation:
            manifests = [g.publisher.role for g in generation.manifests]
            shards = len(generation.shards)
        assert manifests == [r for r, _ in h.path(role)]  # height + 1 manifests at most: never a sibling
        assert shards == (1 if role == 0 else 2)  # its own shard and the root's (the replicated words)
        assert store.objects_opened - before == len(manifests) + shards
    simulate.restore(store, report)  # every role's words come back exactly
    assert max(level["manifests_read"] for level in report.levels.values()) == h.height() + 1


@pytest.mark.parametrize("fault", ["withhold-commit", "wrong-prefix", "extra-role", "wrong-role"])
@pytest.mark.parametrize("role", [1, 2], ids=["interior", "leaf"])  # 7 owners, fan-out 2: role 1 has children
def test_a_bad_or_missing_commitment_publishes_nothing_and_every_role_hears_it_failed(tmp_path, fault, role):
    store = Store(tmp_path / "store")
    report, completions = simulate.publish(store, 7, 2, faults={role: fault})
    assert report.root is None and store.list_refs("sim", "fit") == []
    assert not any(c["ok"] for c in completions)
    expected = {"withhold-commit": "sent no commitment", "wrong-prefix": "captured", "extra-role": "claims a subtree",
                "wrong-role": "claims role"}[fault]
    assert all(expected in c["reason"] for c in completions), completions[0]["reason"]


def _flip_byte(store_root, digest):
    path = os.path.join(store_root, "objects", digest[:2], digest)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(30)
        byte = f.read(1)
        f.seek(30)
        f.write(bytes([byte[0] ^ 1]))


def test_a_damaged_group_manifest_fails_verify_but_not_a_restore_of_another_subtree(tmp_path):
    store = Store(tmp_path / "store")
    report, _ = simulate.publish(store, 7, 2)
    ref = store.list_refs("sim", "fit")[0]
    with open_generation(store, report.root, ref, role=5) as generation:
        leaf = generation.manifests[-1].digest
    _flip_byte(store.root, leaf)
    with pytest.raises(Refusal) as info:
        verify_generation(store, report.root)
    assert info.value.code == RefusalCode.CORRUPT_SHARD
    with pytest.raises(Refusal):
        open_generation(store, report.root, ref, role=5).close()
    open_generation(store, report.root, ref, role=2).close()  # the other subtree never reads it


def _root_manifest(store, root_digest):
    with open_generation(store, root_digest, store.list_refs("sim", "fit")[0], role=0) as generation:
        return generation.manifest


def _republish_root_with_children(store, root_digest, children) -> str:
    """The same root manifest with other child records, published as a new generation; its digest."""
    root = _root_manifest(store, root_digest)
    digest, size = write_manifest(store, root.prefix, root.regions, root.shards, root.owners, root.metadata,
                                  root.publisher, children)
    publish_ref_unfenced(store, root.prefix, digest, size, size, root.owners)  # a forged root
    return digest


def test_a_root_whose_child_record_claims_another_subtree_size_is_refused(tmp_path):
    store = Store(tmp_path / "store")
    report, _ = simulate.publish(store, 7, 2)
    first, second = _root_manifest(store, report.root).children
    digest = _republish_root_with_children(
        store, report.root, (ChildRef(first.role, first.size + 1, first.digest, first.bytes), second))
    for role in (None, 2):
        with pytest.raises(Refusal) as info:
            open_generation(store, digest, role=role).close()
        assert info.value.code == RefusalCode.COVERAGE


def test_a_child_record_naming_an_ancestor_manifest_is_refused(tmp_path):
    """Content addressing makes a true cycle unwritable; the nearest thing, a record naming a root, is refused."""
    store = Store(tmp_path / "store")
    report, _ = simulate.publish(store, 3, 2)
    root = _root_manifest(store, report.root)
    # role 1 "is" the root manifest
    digest = _republish_root_with_children(store, report.root, (ChildRef(1, 1, report.root, root.size),
                                                                root.children[1]))
    with pytest.raises(Refusal) as info:
        open_generation(store, digest).close()
    assert info.value.code == RefusalCode.COVERAGE


def test_no_restore_path_unpickles_or_calls_torch_load(tmp_path, monkeypatch):
    import pickle

    import torch

    def forbidden(*args, **kwargs):
        raise AssertionError("a restore path unpickled")
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    store = Store(tmp_path / "store")
    report, _ = simulate.publish(store, 7, 2)
    verify_generation(store, report.root)
    simulate.restore(store, report)
    import alpha_ckpt
    root = alpha_ckpt.save({"w": torch.ones(5)}, store=store, run="p", step="s", update=1, cursor=1, epoch=0)
    back = {"w": torch.zeros(5)}
    alpha_ckpt.restore(back, store=store, root=root)
    assert torch.equal(back["w"], torch.ones(5))
