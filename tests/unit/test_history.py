"""No lost or forked history: publication refuses what restore refuses, older epochs are fenced, and
latest, --resume latest, retention and gc share one definition of a complete generation."""
import os

import pytest
import torch

import alpha_ckpt
from alpha_ckpt import Refusal, RefusalCode
from alpha_ckpt.store import durable
from alpha_ckpt.format.records import CapturePrefix
from alpha_ckpt.upkeep.gc import apply_gc, plan_gc
from alpha_ckpt.generation.reader import latest_generation, verify_generation
from alpha_ckpt.store import Store
from alpha_ckpt.generation.writer import ShardCarry
from conftest import save_forged


def _save(store_dir, update, *, epoch=0, value=None, **kwargs):
    state = {"model": {"w": torch.full((64,), float(update if value is None else value))},
             "optim": {"m": torch.ones(8)}}
    return alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=update, cursor=update, epoch=epoch,
                           **kwargs)


def _refs(store_dir):
    with Store(store_dir) as s:
        return [(r.generation, r.prefix.update, r.prefix.epoch, r.root) for r in s.list_refs("r", "s")]


def _files(store_dir):
    return sorted(str(p.relative_to(store_dir)) for p in store_dir.rglob("*") if p.is_file())


@pytest.mark.parametrize("compression", ["raw", "zstd"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_state_is_refused_at_publish_naming_its_region_and_nothing_is_published(store_dir, value,
                                                                                                 compression):
    good = _save(store_dir, 1)
    with pytest.raises(Refusal) as info:
        _save(store_dir, 2, value=value, compression=compression)
    assert info.value.code == RefusalCode.NON_FINITE
    assert "'model.w'" in info.value.message and "word 0" in info.value.message
    assert [r[3] for r in _refs(store_dir)] == [good]
    assert alpha_ckpt.latest(store_dir, "r", "s") == good
    verify_generation(Store(store_dir), good)
    assert os.listdir(store_dir / "tmp") == []


def test_a_non_finite_word_deep_in_a_large_region_is_found_while_hashing(store_dir):
    big = torch.zeros(5 << 20)  # several hashing chunks
    big[4_500_001] = float("nan")
    with pytest.raises(Refusal) as info:
        alpha_ckpt.save({"big": big}, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0)
    assert info.value.code == RefusalCode.NON_FINITE and "word 4500001 is nan" in info.value.message
    assert _refs(store_dir) == []


def test_a_region_the_carry_hashed_first_is_still_checked_for_non_finite_words(store_dir):
    carry = ShardCarry()
    table = torch.zeros(1 << 19)  # 2 MiB: a shard of its own, known to the carry after the first save
    alpha_ckpt.save({"table": table}, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0, carry=carry)
    table[7] = float("inf")
    with pytest.raises(Refusal) as info:
        alpha_ckpt.save({"table": table}, store=store_dir, run="r", step="s", update=2, cursor=0, epoch=0,
                        carry=carry)
    assert info.value.code == RefusalCode.NON_FINITE and "'table' word 7" in info.value.message
    assert [r[1] for r in _refs(store_dir)] == [1]


def test_integer_and_bool_regions_are_never_checked_for_finiteness(store_dir):
    state = {"steps": torch.tensor([2**31 - 1, -1], dtype=torch.int32), "mask": torch.tensor([True, False])}
    root = alpha_ckpt.save(state, store=store_dir, run="r", step="s", update=1, cursor=0, epoch=0)
    verify_generation(Store(store_dir), root)


def test_a_publish_of_an_older_epoch_after_a_newer_one_is_fenced(store_dir):
    _save(store_dir, 1, epoch=0)
    newer = _save(store_dir, 2, epoch=1)
    before = _files(store_dir)
    with pytest.raises(Refusal) as info:
        _save(store_dir, 3, epoch=0, value=7.0)
    assert info.value.code == RefusalCode.STALE_EPOCH and newer in info.value.message
    assert [(u, e) for _, u, e, _ in _refs(store_dir)] == [(1, 0), (2, 1)]
    # Objects written before the fence are unreachable scratch; no ref, manifest or generation changed.
    assert [f for f in before if not f.startswith("objects/")] == \
        [f for f in _files(store_dir) if not f.startswith("objects/")]


def test_a_publish_following_a_generation_that_is_no_longer_the_newest_of_its_epoch_is_fenced(store_dir):
    _save(store_dir, 1)
    with Store(store_dir) as s:
        first = s.list_refs("r", "s")[0]
        second = _save(store_dir, 2)  # another job of epoch 0 published after generation 1
        with pytest.raises(Refusal) as info:
            s.publish_ref(CapturePrefix("r", "s", 2, 2, 0), first.root, first.root_size, first.bytes, owners=1,
                          follows=1)
        assert info.value.code == RefusalCode.FENCED and second in info.value.message
        # Following the newest, the same publish goes through.
        s.publish_ref(CapturePrefix("r", "s", 3, 3, 0), first.root, first.root_size, first.bytes, owners=1,
                      follows=2)
        with pytest.raises(Refusal) as info:  # "an empty history" is followed only while there is none
            s.publish_ref(CapturePrefix("r", "s", 4, 4, 0), first.root, first.root_size, first.bytes, owners=1,
                          follows=0)
        assert info.value.code == RefusalCode.FENCED
    assert [g for g, *_ in _refs(store_dir)] == [1, 2, 3]


def test_a_continuation_may_publish_after_an_older_epoch_that_published_since_it_resumed(store_dir):
    _save(store_dir, 1, epoch=0)
    _save(store_dir, 2, epoch=0)  # the first attempt still runs and publishes once more
    with Store(store_dir) as s:
        first = s.list_refs("r", "s")[0]
        s.publish_ref(CapturePrefix("r", "s", 2, 2, 1), first.root, first.root_size, first.bytes, owners=1,
                      follows=1)  # the retry resumed when generation 1 was the newest
    assert [(g, e) for g, _, e, _ in _refs(store_dir)] == [(1, 0), (2, 0), (3, 1)]


def test_a_lost_ref_race_to_a_newer_epoch_is_fenced_not_retried(store_dir, monkeypatch):
    _save(store_dir, 1, epoch=0)
    real = durable._renamer.renameat2_noreplace

    def newer_epoch_wins(src_dir, src, dst_dir, dst):
        if dst == "0000000002":  # the newer epoch's ref lands between our check and our rename
            monkeypatch.setattr(durable._renamer, "renameat2_noreplace", real)
            _save(store_dir, 2, epoch=1)
        return real(src_dir, src, dst_dir, dst)

    monkeypatch.setattr(durable._renamer, "renameat2_noreplace", newer_epoch_wins)
    with pytest.raises(Refusal) as info:
        _save(store_dir, 2, epoch=0, value=5.0)
    assert info.value.code == RefusalCode.STALE_EPOCH
    assert [(g, e) for g, _, e, _ in _refs(store_dir)] == [(1, 0), (2, 1)]


def test_latest_skips_generations_of_an_older_epoch_than_the_newest(store_dir):
    _save(store_dir, 1, epoch=0)
    continued = _save(store_dir, 2, epoch=1)
    # What an older store could hold: an epoch-0 generation after the continuation's.
    save_forged({"model": {"w": torch.full((64,), 3.0)}, "optim": {"m": torch.ones(8)}}, store_dir, update=3,
                cursor=3, epoch=0)
    with Store(store_dir) as s:
        record, skipped = latest_generation(s, "r", "s")
    assert record.root == continued
    assert [r.code for _, r in skipped] == [RefusalCode.STALE_EPOCH]
    assert alpha_ckpt.latest(store_dir, "r", "s") == continued


def _diverged_history(store_dir):
    """Generation 1 intact; 2-4 hold NaN (what publication refuses now, and an older job published)."""
    good = _save(store_dir, 1)
    for update in (2, 3, 4):
        save_forged({"model": {"w": torch.full((64,), float("nan"))}, "optim": {"m": torch.ones(8)}}, store_dir,
                    update=update, cursor=update)
    return good


def test_gc_never_removes_the_newest_generation_that_validates(store_dir):
    good = _diverged_history(store_dir)
    with Store(store_dir) as s:
        plan = plan_gc(s, keep=2, grace=0)
        apply_gc(s, plan)
        assert plan.refs == []  # only one complete generation: nothing is beyond retention
        assert alpha_ckpt.latest(s, "r", "s") == good
        verify_generation(s, good)


def test_gc_counts_the_same_generations_complete_as_latest(store_dir):
    _save(store_dir, 1)
    second = _save(store_dir, 2)
    third = _save(store_dir, 3)
    save_forged({"model": {"w": torch.full((64,), float("inf"))}, "optim": {"m": torch.ones(8)}},
                            store_dir, update=4, cursor=4)
    with Store(store_dir) as s:
        plan = plan_gc(s, keep=2, grace=0)
        apply_gc(s, plan)
        assert [r.prefix.update for r in plan.refs] == [1]
        assert [r.root for r in s.list_refs("r", "s")][:2] == [second, third]
        assert alpha_ckpt.latest(s, "r", "s") == third


def test_gc_remembers_what_it_validated_and_validates_again_when_an_object_changes(store_dir):
    roots = [_save(store_dir, u) for u in (1, 2, 3)]
    with Store(store_dir) as s:
        first = plan_gc(s, keep=2, grace=0)
        again = plan_gc(s, keep=2, grace=0)
        assert first.validated == 2 and again.validated == 0
        shard = next(d for d in s.iter_objects() if d not in roots and os.path.getsize(s.object_path(d)) > 256
                     and _reaches(s, roots[2], d))
        path = s.object_path(shard)
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 1  # a byte flipped in place: the file's mtime and ctime change
        os.chmod(path, 0o644)
        open(path, "wb").write(data)
        damaged = plan_gc(s, keep=2, grace=0)
        # The newest no longer validates: retention keeps it and the two complete ones below it.
        assert damaged.validated >= 1 and damaged.refs == []


def _reaches(store, root, digest):
    from alpha_ckpt.generation.reader import open_generation
    with open_generation(store, root, wanted=[]) as g:
        return digest in {s.digest for m in g.manifests for s in m.shards}


def test_a_hostile_or_damaged_verified_record_only_costs_a_validation(store_dir, tmp_path):
    roots = [_save(store_dir, u) for u in (1, 2, 3)]
    with Store(store_dir) as s:
        assert plan_gc(s, keep=2, grace=0).validated == 2
        records = store_dir / "verified"
        newest = records / roots[2]
        newest.write_bytes(newest.read_bytes().replace(b'"kind"', b'"kinD"'))  # damaged: its checksum fails
        os.unlink(records / roots[1])
        os.mkfifo(records / roots[1])  # a FIFO where a record should be: never opened blocking
        assert plan_gc(s, keep=2, grace=0).validated == 2
        os.rename(records, tmp_path / "elsewhere")
        os.symlink(tmp_path / "elsewhere", records)  # a symlinked directory is not trusted
        plan = plan_gc(s, keep=2, grace=0)
        apply_gc(s, plan)
        assert plan.validated == 2 and [r.root for r in s.list_refs("r", "s")] == roots[1:]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_the_finiteness_rule_finds_exactly_the_first_non_finite_word(dtype):
    from hypothesis import given, settings, strategies as st
    from alpha_ckpt.state.manifest import dtype_name, first_non_finite
    big = float(torch.finfo(dtype).max)
    values = st.sampled_from([0.0, 1.0, -2.5, big, -big, float("nan"), float("inf"), float("-inf")])

    @settings(max_examples=200, deadline=None)
    @given(st.lists(values, min_size=0, max_size=64))
    def check(words):
        t = torch.tensor(words, dtype=dtype)
        expected = next((i for i, ok in enumerate(torch.isfinite(t).tolist()) if not ok), None)
        raw = memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        assert first_non_finite(raw, dtype_name(dtype, "test")) == expected

    check()
    # Large finite words whose sum overflows are still finite.
    assert first_non_finite(memoryview(torch.full((64,), big, dtype=dtype).view(torch.uint8).numpy()),
                            dtype_name(dtype, "test")) is None
