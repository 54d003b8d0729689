"""Objects carried between ranks' holders over gloo: every copy verified before it is stored, no rank left waiting."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alpha_ckpt.api import save
from alpha_ckpt.tiers.memory.plan import Transfer, plan_replication
from alpha_ckpt.generation.reader import validate_object_file
from alpha_ckpt.store import Store, write_all

from ranks import run_ranks

WORLD = 3


def saved_objects(store_dir: Path) -> dict[str, bytes]:
    """Every object of a few small generations (several shards each, a large one, NaN words a region allows)."""
    g = torch.Generator().manual_seed(0)
    with Store(store_dir) as store:
        for update in (1, 2):
            state = {"w": torch.randn(64, 33, generator=g), "b": torch.randn(300, generator=g).double(),
                     "mask": torch.tensor([1.0, float("nan"), float("inf")]), "step": torch.tensor(update)}
            save(state, store=store, run="r", step="s", update=update, cursor=update, epoch=0,
                 max_shard_bytes=4096, allow_nonfinite="mask")
        save({"big": torch.randn(600_000, generator=g)}, store=store, run="r", step="big", update=1, cursor=1, epoch=0)
        return {d: read(store, d) for d in store.iter_objects()}


def read(store: Store, digest: str) -> bytes:
    with store.open_object(digest, "object") as obj:
        return bytes(obj.view())


def put(store: Store, digest: str, data: bytes) -> None:
    """Store ``data`` under ``digest`` whatever it holds (a damaged copy, when it does not match)."""
    def write(fd: int) -> str:
        write_all(fd, data)
        return digest
    store.put_objects([write], validate=validate_object_file)


def holder_dir(tmp_path: Path, rank: int) -> str:
    return str(tmp_path / f"holder{rank}")


def run_plan(rank: int, world: int, holders_root: str, rows: list, window_bytes: int) -> dict:
    from alpha_ckpt.tiers.memory.plan import Transfer
    from alpha_ckpt.tiers.memory.transfer import run_transfers
    from alpha_ckpt.store import Store
    with Store(str(Path(holders_root) / f"holder{rank}")) as holder:
        try:
            report = run_transfers([Transfer(*row) for row in rows], holder, rank, window_bytes=window_bytes)
        except ValueError as exc:
            return {"refused": str(exc)}
    return {"sent": report.bytes_sent, "received": report.bytes_received, "damaged": report.damaged,
            "unavailable": report.unavailable, "not_stored": report.not_stored}


def held(tmp_path: Path, rank: int) -> dict[str, bytes]:
    with Store(holder_dir(tmp_path, rank)) as store:
        return {d: read(store, d) for d in store.iter_objects()}


def run(tmp_path: Path, transfers: list[Transfer], window_bytes: int = 256 << 20) -> list[dict]:
    rows = [[t.digest, t.size, t.src, t.dst] for t in transfers]
    return run_ranks(WORLD, run_plan, str(tmp_path), rows, window_bytes, tmp=tmp_path, timeout=90, pg_timeout=30)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("window_bytes", [256 << 20, 8192])  # one window, and many (a large object alone)
def test_replication_leaves_every_holder_with_exactly_the_planned_objects_byte_for_byte(tmp_path, window_bytes):
    objects = saved_objects(tmp_path / "source")
    digests = sorted(objects)
    assert len(digests) >= 9
    holders: dict[str, frozenset[int]] = {}
    for i, d in enumerate(digests):  # one writer each; a few already on two ranks; one on none
        holders[d] = frozenset() if i == 0 else frozenset({i % WORLD, (i + 1) % WORLD}) if i % 4 == 0 \
            else frozenset({i % WORLD})
    for r in range(WORLD):
        with Store(holder_dir(tmp_path, r)) as store:
            for d in digests:
                if r in holders[d]:
                    put(store, d, objects[d])
    manifests = frozenset(digests[1:3])  # held everywhere, whatever they are
    transfers = plan_replication([(d, len(objects[d])) for d in digests], holders, WORLD, copies=2,
                                 everywhere=manifests)
    assert transfers

    reports = run(tmp_path, transfers, window_bytes)

    for r in range(WORLD):
        expected = {d for d in digests if r in holders[d]} | {t.digest for t in transfers if t.dst == r}
        have = held(tmp_path, r)
        assert set(have) == expected
        assert all(have[d] == objects[d] for d in have)
        assert reports[r] == {"sent": sum(t.size for t in transfers if t.src == r),
                              "received": sum(t.size for t in transfers if t.dst == r),
                              "damaged": [], "unavailable": [], "not_stored": []}
    for d in digests[1:]:
        copies = sum(d in held(tmp_path, r) for r in range(WORLD))
        assert copies == (WORLD if d in manifests else max(2, len(holders[d])))


def two_copies_to_send(tmp_path: Path) -> tuple[dict[str, bytes], list[str]]:
    objects = saved_objects(tmp_path / "source")
    big = max(objects, key=lambda d: len(objects[d]))
    small = sorted(d for d in objects if d != big)[:2]
    return objects, [big] + small


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["head", "payload", "last byte"])
def test_a_copy_damaged_at_its_source_is_reported_damaged_at_its_destination_and_not_stored(tmp_path, where):
    objects, (bad, good, other) = two_copies_to_send(tmp_path)
    flipped = bytearray(objects[bad])
    position = {"head": 30, "payload": len(flipped) // 2, "last byte": len(flipped) - 1}[where]
    flipped[position] ^= 0x01
    with Store(holder_dir(tmp_path, 0)) as source:
        put(source, bad, bytes(flipped))
        put(source, good, objects[good])
    with Store(holder_dir(tmp_path, 2)) as source:
        put(source, other, objects[other])
    transfers = [Transfer(bad, len(objects[bad]), 0, 1), Transfer(good, len(objects[good]), 0, 1),
                 Transfer(bad, len(objects[bad]), 0, 2), Transfer(other, len(objects[other]), 2, 1)]

    reports = run(tmp_path, transfers)

    assert held(tmp_path, 1) == {good: objects[good], other: objects[other]}  # the good copies still arrived
    assert held(tmp_path, 2) == {other: objects[other]}
    assert reports[1]["damaged"] == [bad] and reports[2]["damaged"] == [bad] and reports[0]["damaged"] == []
    assert reports[0]["sent"] == 2 * len(objects[bad]) + len(objects[good])
    assert reports[1]["received"] == len(objects[bad]) + len(objects[good]) + len(objects[other])


@pytest.mark.timeout(180)
def test_a_source_without_its_copy_reports_it_unavailable_and_its_destination_gets_nothing(tmp_path):
    objects, (gone, good, other) = two_copies_to_send(tmp_path)
    with Store(holder_dir(tmp_path, 1)) as source:  # the plan says rank 1 holds `gone`: it does not
        put(source, good, objects[good])
    transfers = [Transfer(gone, len(objects[gone]), 1, 2), Transfer(good, len(objects[good]), 1, 2),
                 Transfer(gone, len(objects[gone]), 1, 0)]

    reports = run(tmp_path, transfers, window_bytes=1)  # a window per transfer: each one stays in step

    assert reports[1]["unavailable"] == [gone, gone]
    assert held(tmp_path, 2) == {good: objects[good]} and held(tmp_path, 0) == {}
    assert [r["damaged"] for r in reports] == [[], [], []]
    assert reports[1]["sent"] == reports[2]["received"] == len(objects[good]) and reports[0]["received"] == 0


@pytest.mark.timeout(180)
def test_a_copy_of_another_size_than_planned_is_damaged_and_not_sent(tmp_path):
    objects, (wrong, good, _) = two_copies_to_send(tmp_path)
    with Store(holder_dir(tmp_path, 2)) as source:
        put(source, wrong, objects[wrong])
        put(source, good, objects[good])
    transfers = [Transfer(wrong, len(objects[wrong]) + 1, 2, 0), Transfer(good, len(objects[good]), 2, 0)]

    reports = run(tmp_path, transfers)

    assert held(tmp_path, 0) == {good: objects[good]}
    assert reports[0]["damaged"] == [wrong] and reports[0]["received"] == len(objects[good])
    assert reports[2]["sent"] == len(objects[good]) and reports[2]["unavailable"] == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bad", [Transfer("ab" * 32, 5, 1, 1), Transfer("ab" * 32, 5, 0, 3),
                                 Transfer("ab" * 32, -1, 0, 1), Transfer("not a digest", 5, 0, 1)])
def test_a_plan_the_group_cannot_carry_out_is_refused_by_every_rank_before_any_message(tmp_path, bad):
    objects, (good, _, _) = two_copies_to_send(tmp_path)
    with Store(holder_dir(tmp_path, 0)) as source:
        put(source, good, objects[good])

    reports = run(tmp_path, [Transfer(good, len(objects[good]), 0, 1), bad])

    assert all(set(r) == {"refused"} or set(r) == {"refusal", "message"} for r in reports)
    assert held(tmp_path, 1) == {}
