"""Random jobs against the memory tier, and the oracle of what every restore must give.

A case is a JSON plan: one or two stores (the same tier directory or one each), then a sequence of jobs,
each on one store: a restore of "latest" (or, one job in ten, a probe under another learner identity that
only restores), one to four saves, an
end with close() or a crash (the processes go on, the Checkpointer is dropped unclosed: its memory
generations stay, as a killed job's do). Between jobs: a store deleted and made anew at its path (a new
experiment), rolled back (its newest ref removed), a flipped byte in a holder's copy of the newest memory
generation, lost holders (a rank's node memory gone).

Every state saved is named by a key (store, incarnation of the store, job, update) and its tensors are
drawn from that key, so a rank sees from the state alone whose it is. :func:`expected` is the oracle,
pure: from the plan, the key every restore must give (None: a fresh start), or the refusal it must
raise before it writes a byte. :func:`run_case` runs the plan on every rank and reports what each restore
gave. A restore is right when every rank reports the oracle's key, with tensors that are exactly that
key's, or the oracle's refusal with the destination untouched.
"""
from __future__ import annotations

import json
import os
import random
import shutil

IDENTITY = {"model": "gate"}
OTHER_IDENTITY = {"model": "another"}


# ---------------------------------------------------------------------------------------------- plans

def draw_case(rng: random.Random, world: int) -> dict:
    """One random case for ``world`` ranks."""
    stores = rng.choice([1, 2])
    jobs, events = [], []
    for j in range(rng.randint(2, 5)):
        events.append(_draw_event(rng, stores, world) if j else None)
        jobs.append({"store": rng.randrange(stores), "saves": rng.randint(1, 4), "durable_every": rng.randint(1, 3),
                     "end": rng.choice(["crash", "crash", "close"]), "other_identity": rng.random() < 0.1})
    return {"world": world, "replicas": rng.choice([1, 2]) if world > 2 else 1, "stores": stores,
            "shared_tier": rng.random() < 0.5, "jobs": jobs, "events": events,
            "final": _draw_event(rng, stores, world)}


def _draw_event(rng: random.Random, stores: int, world: int) -> dict | None:
    kind = rng.choice([None, None, "recreate", "rollback", "flip", "lose"])
    if kind is None:
        return None
    event = {"kind": kind, "store": rng.randrange(stores)}
    if kind == "flip":
        event.update(rank=rng.randrange(world), pick=rng.randrange(1 << 16))
    if kind == "lose":
        event["ranks"] = sorted(rng.sample(range(world), rng.randint(1, world)))
    return event


# ---------------------------------------------------------------------------------------------- oracle

class _Store:
    def __init__(self):
        self.incarnation = 0
        self.refs: list[list] = []     # [generation, key, epoch, update], oldest first
        self.memory: list[dict] = []   # this incarnation's memory generations, oldest first (the 2 newest kept)
        self.top = 0                   # the highest generation number taken
        self.damaged: set[tuple] = set()  # keys of memory generations with a flipped copy


def expected(case: dict) -> list:
    """For each job's restore, then the final restore of every store: the key it must give (a list, as
    JSON has it), None for a fresh start, or {"refusal": code}."""
    world, copies = case["world"], 1 + case["replicas"]
    stores = [_Store() for _ in range(case["stores"])]
    out = []
    for j, job in enumerate(case["jobs"]):
        _apply(stores, case["events"][j], world, copies)
        s = stores[job["store"]]
        got = _restore(s, world, copies)
        if job["other_identity"]:  # a probe of another model: refused where there is a state, never saves
            out.append({"refusal": "foreign-learner"} if got is not None else None)
            if job["end"] == "close":  # close() discards this job's holders
                s.memory, s.damaged = [], set()
            continue
        out.append(None if got is None else got["key"])
        epoch = got["epoch"] + 1 if got is not None else 0
        update = got["key"][3] if got is not None else 0
        follows = s.refs[-1][:2] if s.refs else None  # what the job's history continues (the store's newest)
        since_durable = None
        for _ in range(job["saves"]):
            update += 1
            key = [job["store"], s.incarnation, j, update]
            durable = since_durable is None or since_durable + 1 >= job["durable_every"]
            lineage_follows = follows
            if durable:
                s.top += 1
                s.refs.append([s.top, key, epoch, update])
                follows, since_durable = [s.top, key], 0
            else:
                since_durable += 1
            s.memory.append({"key": key, "epoch": epoch, "update": update, "follows": lineage_follows,
                             "lost": set()})  # every rank holds it (a lost holder was made anew by the job)
            s.memory = s.memory[-2:]
        if job["end"] == "close":
            s.memory, s.damaged = [], set()
    _apply(stores, case["final"], world, copies)
    for s in stores:
        got = _restore(s, world, copies)
        out.append(None if got is None else got["key"])
    return out


def _apply(stores: list[_Store], event: dict | None, world: int, copies: int) -> None:
    if event is None:
        return
    s = stores[event["store"]]
    if event["kind"] == "recreate":
        s.incarnation += 1
        s.refs, s.memory, s.top, s.damaged = [], [], 0, set()
    elif event["kind"] == "rollback" and s.refs:
        s.refs.pop()
        s.top = s.refs[-1][0] if s.refs else 0  # the number is free again: a later publish takes it
    elif event["kind"] == "flip" and s.memory and event["rank"] not in s.memory[-1]["lost"]:
        s.damaged.add(tuple(s.memory[-1]["key"]))  # the newest generation that holder names
    elif event["kind"] == "lose":
        for m in s.memory:
            m["lost"] |= set(event["ranks"])


def _holds(s: _Store, generation_and_key) -> bool:
    return any(r[:2] == list(generation_and_key) for r in s.refs)


def _restore(s: _Store, world: int, copies: int) -> dict | None:
    """What restore("latest") takes from store ``s`` and its memory tier (see the module docstring)."""
    durable = {"key": s.refs[-1][1], "epoch": s.refs[-1][2]} if s.refs else None
    taken = None
    for m in sorted(s.memory, key=lambda m: (m["epoch"], m["update"]), reverse=True):
        if len(m["lost"]) < world:  # a holder that names it is left
            in_store = any(r[1] == m["key"] for r in s.refs)
            if in_store or (m["follows"] is not None and _holds(s, m["follows"])):
                taken = m
                break
    if taken is not None:
        newest = s.refs[-1] if s.refs else None
        newer = newest is None or newest[1] == taken["key"] or (taken["epoch"], taken["update"]) > tuple(newest[2:4])
        orphaned = any(all((w + i) % world in taken["lost"] for i in range(copies)) for w in range(world))
        if newer and not orphaned and tuple(taken["key"]) not in s.damaged:
            return {"key": taken["key"], "epoch": taken["epoch"]}
    return durable


# ---------------------------------------------------------------------------------------------- ranks

def state_at(key, rank: int, world: int) -> dict:
    """The state saved under ``key`` (every region differs from every other key's)."""
    import blake3
    import torch
    from alpha_ckpt import PerRank
    g = torch.Generator().manual_seed(int(blake3.blake3(json.dumps(key).encode()).hexdigest()[:15], 16))
    return {"w": torch.randn(24, 17, generator=g), "m": torch.randn(3000, generator=g),
            "own": PerRank(torch.randn(9, generator=g) + rank), "progress": {"key": list(key)}}


def _blank() -> dict:
    import torch
    from alpha_ckpt import PerRank
    return {"w": torch.zeros(24, 17), "m": torch.zeros(3000), "own": PerRank(torch.zeros(9)),
            "progress": {"key": None}}


def _exact(state: dict, want: dict) -> bool:
    import torch
    return all(torch.equal(state[k], want[k]) for k in ("w", "m")) and torch.equal(state["own"].value,
                                                                                   want["own"].value)


def run_case(rank: int, world: int, case: dict, tmp: str) -> list:
    """Every rank: run ``case`` under ``tmp``; per restore, what it gave (see :func:`expected`)."""
    import torch.distributed as dist
    from alpha_ckpt import Checkpointer, Refusal

    stores = [os.path.join(tmp, f"store-{i}") for i in range(case["stores"])]
    tiers = [os.path.join(tmp, "tier" if case["shared_tier"] else f"tier-{i}") for i in range(case["stores"])]
    out = []

    def restore(i: int, identity, durable_every: int | None = None) -> tuple:
        ckpt = Checkpointer(stores[i], run="p", identity=identity, memory=tiers[i], replicas=case["replicas"],
                            durable_every=durable_every)
        state = _blank()
        try:
            counters = ckpt.restore(state)
        except Refusal as refusal:
            untouched = _exact(state, _blank()) and state["progress"]["key"] is None
            return ckpt, None, {"refusal": refusal.code.value, "untouched": untouched}
        if counters is None:
            return ckpt, None, {"key": None, "untouched": _exact(state, _blank())}
        key = state["progress"]["key"]
        return ckpt, counters, {"key": key, "exact": _exact(state, state_at(key, rank, world)),
                                "tier": ckpt.last_restore["tier"], "update": counters.update}

    for j, job in enumerate(case["jobs"]):
        _event(case["events"][j], stores, tiers, rank, world)
        i = job["store"]
        ckpt, counters, got = restore(i, OTHER_IDENTITY if job["other_identity"] else IDENTITY, job["durable_every"])
        out.append(got)
        if "refusal" not in got and not job["other_identity"]:
            update = counters.update if counters is not None else 0
            for _ in range(job["saves"]):
                update += 1
                ckpt.save(state_at([i, _incarnation(stores[i]), j, update], rank, world), update=update)
        if job["end"] == "close":
            ckpt.close()
        del ckpt  # a crash: no close(); its memory generations stay in the tier
        dist.barrier()
    _event(case["final"], stores, tiers, rank, world)
    for i in range(case["stores"]):
        ckpt, _, got = restore(i, IDENTITY)
        out.append(got)
        ckpt.close()
    return out


def _incarnation(store: str) -> int:
    with open(os.path.join(store, "incarnation")) as f:
        return int(f.read())


def _event(event: dict | None, stores: list[str], tiers: list[str], rank: int, world: int) -> None:
    """Rank 0 changes the files an event names; every rank waits for it. The stores are made here too,
    each with the number of its incarnation beside its own files."""
    import torch.distributed as dist
    from alpha_ckpt.tiers.memory.tier import holder_directory, holders_of
    from alpha_ckpt.store import RefRecord, Store
    if rank == 0:
        for store in stores:
            if not os.path.exists(store):
                Store(store).close()
                with open(os.path.join(store, "incarnation"), "w") as f:
                    f.write("0")
        if event is not None:
            store, tier = stores[event["store"]], tiers[event["store"]]
            kind = event["kind"]
            if kind == "recreate":
                n = _incarnation(store) + 1
                shutil.rmtree(store)
                Store(store).close()
                with open(os.path.join(store, "incarnation"), "w") as f:
                    f.write(str(n))
            elif kind == "rollback":
                with Store(store, create=False) as s:
                    newest = s.newest_ref("p", "train")
                    if newest is not None:
                        s.delete_ref("p", "train", newest.generation)
            elif kind in ("flip", "lose") and os.path.isdir(tier):
                holders = holders_of(tier, store)
                for r in (event["ranks"] if kind == "lose" else []):
                    shutil.rmtree(holder_directory(holders, r), ignore_errors=True)
                if kind == "flip" and os.path.isdir(holder_directory(holders, event["rank"])):
                    _flip_newest(Store(holder_directory(holders, event["rank"]), create=False), event["pick"],
                                 RefRecord)
    dist.barrier()


def _flip_newest(holder, pick: int, RefRecord) -> None:
    from alpha_ckpt.generation.opening import open_generation
    with holder:
        refs = [r for r in holder.list_refs("p", "train") if isinstance(r, RefRecord)]
        if not refs:
            return
        newest = max(refs, key=lambda r: (r.prefix.epoch, r.prefix.update))
        with open_generation(holder, newest.root, role=0, wanted=[]) as head:
            named = sorted({newest.root} | {s.digest for s in head.manifest.shards})
        held = [d for d in named if holder.has_object(d)]
        path = holder.object_path(held[pick % len(held)])
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def check(case: dict, results: list[list]) -> str | None:
    """None when every rank's every restore is the oracle's; else what differs, first."""
    want = expected(case)
    for rank, got in enumerate(results):
        if len(got) != len(want):
            return f"rank {rank}: {len(got)} restores, the oracle has {len(want)}"
        for n, (g, w) in enumerate(zip(got, want)):
            where = f"rank {rank}, restore {n}"
            if isinstance(w, dict):
                if g.get("refusal") != w["refusal"] or not g.get("untouched"):
                    return f"{where}: expected a refusal {w['refusal']} before any write, got {g}"
            elif "refusal" in g:
                return f"{where}: refused {g['refusal']}, expected {w}"
            elif g["key"] != w:
                return f"{where}: restored {g['key']}, expected {w}"
            elif w is None and not g["untouched"]:
                return f"{where}: a fresh start wrote into the state"
            elif w is not None and not g["exact"]:
                return f"{where}: the state restored as {w} is not that state's bytes"
    return None


# ---------------------------------------------------------------------------------------------- kills inside a save

def draw_kill(rng: random.Random, world: int) -> dict:
    """A job killed inside its k-th save: every rank dies at its ``at``-th durable-commit stage of that save
    (or right after it, when the save has fewer), so ranks die at different moments of one publish."""
    saves = rng.randint(1, 4)
    return {"world": world, "replicas": rng.choice([1, 2]) if world > 2 else 1,
            "durable_every": rng.randint(1, 3), "killed_save": saves,
            "at": [rng.randint(1, 40) for _ in range(world)]}


class _KillAt:
    """Hooks: SIGKILL this process at the ``at``-th fault point once armed."""

    def __init__(self, at: int):
        self.at, self.seen, self.armed = at, 0, False

    def fault(self, kind, point):
        if self.armed:
            self.seen += 1
            if self.seen >= self.at:
                os.kill(os.getpid(), 9)

    def tamper(self, role, message):
        return message

    def after_update(self, rank, update):
        pass


def save_until_killed(rank: int, world: int, kill: dict, store: str, tier: str) -> None:
    """Every rank: saves 1..k, armed to die inside save k (and dies after it at the latest)."""
    from alpha_ckpt import Checkpointer
    from alpha_ckpt.runtime import hooks
    hook = _KillAt(kill["at"][rank])
    hooks.install(hook)
    ckpt = Checkpointer(store, run="p", identity=IDENTITY, memory=tier, replicas=kill["replicas"],
                        durable_every=kill["durable_every"])
    ckpt.restore(_blank())
    for update in range(1, kill["killed_save"] + 1):
        hook.armed = update == kill["killed_save"]
        ckpt.save(state_at([0, 0, 0, update], rank, world), update=update)
    os.kill(os.getpid(), 9)  # killed right after the save, if not inside it


def restore_after_kill(rank: int, world: int, store: str, tier: str) -> dict:
    from alpha_ckpt import Checkpointer
    ckpt = Checkpointer(store, run="p", identity=IDENTITY, memory=tier)
    state = _blank()
    counters = ckpt.restore(state)
    key = state["progress"]["key"] if counters is not None else None
    exact = _exact(state, state_at(key, rank, world) if key is not None else _blank())
    ckpt.close()
    return {"key": key, "exact": exact}


def check_kill(kill: dict, results: list[dict]) -> str | None:
    """A restore after a kill inside save k gives save k or save k-1 (a fresh start for k = 1), the same on
    every rank, bit for bit."""
    k = kill["killed_save"]
    allowed = [[0, 0, 0, k], [0, 0, 0, k - 1] if k > 1 else None]
    keys = [r["key"] for r in results]
    if any(key != keys[0] for key in keys):
        return f"the ranks restored different states: {keys}"
    if keys[0] not in allowed:
        return f"restored {keys[0]}, expected one of {allowed}"
    if not all(r["exact"] for r in results):
        return f"the state restored as {keys[0]} is not that state's bytes"
    return None
