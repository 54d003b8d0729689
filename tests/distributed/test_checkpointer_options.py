"""The Checkpointer's options: checked in one place, read from alpha-run only by from_launcher_env, and one
resume rule whether a script runs under plain torch.distributed or under alpha-run."""

import pytest
import torch

from alpha_ckpt import Checkpointer, CheckpointerOptions, RefusalCode, UsageError
from alpha_ckpt.runtime import launch_env
from alpha_ckpt.launch.launcher import parse, script_environment
from ranks import run_ranks


@pytest.mark.parametrize("bad", [
    {"publisher": "ring"}, {"fanout": 0}, {"commit_timeout": 0}, {"commit_timeout": float("inf")},
    {"save": "later"}, {"in_flight": "drop"}, {"keep": 1}, {"keep": True}, {"every": 0},
    {"every": "auto"}, {"mtbf": 5}, {"metadata": {"identity": 1}}, {"metadata": {"x": float("nan")}},
    {"identity": {1.5: "x"}}, {"allow_nonfinite": b"*.mask"}, {"run": "../x"}, {"step": ""},
    {"resume": "newest"}, {"resume": "ab" * 31},
])
def test_an_option_that_cannot_be_is_a_usage_error(tmp_path, bad):
    with pytest.raises(UsageError):
        CheckpointerOptions(**{"store": str(tmp_path / "s"), "run": "r", **bad})


def test_options_are_normalized_once():
    options = CheckpointerOptions(store="s", run="r", allow_nonfinite="*.mask", commit_timeout=5)
    assert options.allow_nonfinite == ("*.mask",) and options.commit_timeout == 5.0
    assert options.resume == "latest" and not options.announce
    assert options.replace(resume=None).resume is None
    with pytest.raises(UsageError):
        options.replace(keep=1)


def test_from_launcher_env_outside_alpha_run_is_a_usage_error_naming_what_is_missing(monkeypatch):
    monkeypatch.delenv(launch_env.OPTIONS, raising=False)
    with pytest.raises(UsageError) as missing:
        Checkpointer.from_launcher_env()
    assert launch_env.OPTIONS in str(missing.value)


def test_what_alpha_run_writes_is_what_from_launcher_env_reads(tmp_path, monkeypatch):
    args = parse(["--nproc", "2", "--store", str(tmp_path / "s"), "--run", "r", "--publisher", "tree",
                  "--fanout", "3", "--save", "async", "--checkpoint-every", "auto", "--mtbf", "6h",
                  str(tmp_path / "train.py")])
    for name, value in script_environment(args).items():
        monkeypatch.setenv(name, value)
    settings = launch_env.launcher_settings()
    assert settings == {"store": str(tmp_path / "s"), "run": "r", "publisher": "tree",
                        "fanout": 3, "save": "async", "every": "auto", "mtbf": "6h"}  # only what a flag gave
    assert CheckpointerOptions(**settings).resume == "latest"  # no --resume flag: the option's default
    options = CheckpointerOptions(**settings)  # every value alpha-run passes is a valid option
    assert (options.commit_timeout, options.in_flight, options.fanout) == (60.0, "wait", 3)


def _alpha_run_environment(store: str, resume: list[str]) -> dict:
    return script_environment(parse(["--nproc", "2", "--store", store, "--run", "r", *resume, "train.py"]))


def save_then_resume(rank, world, store, launched):
    """Two updates saved, then a new Checkpointer restores without naming a root: what does it resume?"""
    import os
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    if launched:  # what alpha-run hands its ranks, and nothing else
        os.environ.update(_alpha_run_environment(store, []))
        make = Checkpointer.from_launcher_env
    else:  # plain torchrun: the script names its store and run
        make = lambda: Checkpointer(store, run="r")  # noqa: E731
    ckpt = make()
    assert ckpt.restore({"model": model}) is None  # nothing yet: a fresh start
    roots = []
    for update in (1, 2):
        with torch.no_grad():
            model.weight.add_(1.0)
        roots.append(ckpt.save({"model": model}, update=update).root)
    ckpt.close()
    saved = model.weight.detach().clone()
    fresh = torch.nn.Linear(16, 16)
    ckpt = make()
    counters = ckpt.restore({"model": fresh})
    ckpt.close()
    return {"update": counters.update, "root": counters.root, "newest": roots[-1],
            "equal": bool(torch.equal(fresh.weight, saved))}


@pytest.mark.timeout(180)
def test_the_same_script_resumes_the_newest_generation_under_plain_torch_distributed_and_under_alpha_run(tmp_path):
    plain = run_ranks(2, save_then_resume, str(tmp_path / "plain"), False, tmp=tmp_path)
    launched = run_ranks(2, save_then_resume, str(tmp_path / "launched"), True, tmp=tmp_path)
    for result in plain + launched:
        assert result["update"] == 2 and result["equal"] and result["root"] == result["newest"]
    assert plain[0]["root"] == launched[0]["root"]  # the same state, the same generation: the same root digest


def fresh_start_over_history(rank, world, store, how):
    import os
    model = torch.nn.Linear(4, 4)
    ckpt = Checkpointer(store, run="r")
    ckpt.restore({"model": model})
    ckpt.save({"model": model}, update=1)
    ckpt.close()
    if how == "option":
        ckpt = Checkpointer(store, run="r", resume=None)
        ckpt.restore({"model": model})
    elif how == "argument":
        ckpt = Checkpointer(store, run="r")
        ckpt.restore({"model": model}, None)
    else:  # no store: alpha-run's settings are from_launcher_env()'s, never read behind the caller's back
        os.environ.update(_alpha_run_environment(store, []))
        try:
            Checkpointer()
        except UsageError as exc:
            return {"usage-error": "from_launcher_env" in str(exc)}
    return {"restored": True}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["option", "argument"])
def test_a_fresh_start_of_a_run_with_history_is_refused_fenced_on_every_rank(tmp_path, how):
    results = run_ranks(2, fresh_start_over_history, str(tmp_path / "s"), how, tmp=tmp_path)
    assert [r.get("refusal") for r in results] == [RefusalCode.FENCED.value] * 2


@pytest.mark.timeout(120)
def test_checkpointer_without_a_store_is_a_usage_error_pointing_to_from_launcher_env_even_under_alpha_run(tmp_path):
    results = run_ranks(2, fresh_start_over_history, str(tmp_path / "s"), "no-store", tmp=tmp_path)
    assert results == [{"usage-error": True}] * 2



def save_in_each_mode(rank, world, store):
    import threading
    from alpha_ckpt import SaveResult
    state = {"w": torch.arange(8.0)}
    out = {}
    sync = Checkpointer(store, run="sync")
    done = sync.save(state, update=1)
    out["sync"] = [isinstance(done, SaveResult), done.done(), done.skipped, done.result(), done.root,
                   done.stats["generation"]]
    sync.close()
    background = Checkpointer(store, run="async", save="async", in_flight="skip")
    publish = background._exchange
    asked = threading.Event()

    def slow(*args):
        asked.wait(60)  # the first save is still in flight when the second is asked for
        return publish(*args)
    background._exchange = slow
    first = background.save(state, update=1)
    second = background.save(state, update=2)
    asked.set()
    out["skipped"] = [isinstance(second, SaveResult), second.skipped, second.done(), second.root]
    root = first.root  # waits until durable
    out["async"] = [isinstance(first, SaveResult), first.done(), first.skipped, len(root), first.stats["update"]]
    background.close()
    return out


@pytest.mark.timeout(120)
def test_save_returns_one_type_in_every_mode(tmp_path):
    results = run_ranks(2, save_in_each_mode, str(tmp_path / "s"), tmp=tmp_path)
    assert results[0] == results[1]
    sync, skipped, background = results[0]["sync"], results[0]["skipped"], results[0]["async"]
    assert sync[:3] == [True, True, False] and sync[3] == sync[4] and len(sync[3]) == 64 and sync[5] == 1
    assert skipped == [True, True, True, None]
    assert background == [True, True, False, 64, 1]


def save_and_read_phases(rank, world, store, publisher, memory):
    state = {"w": torch.arange(64.0) + rank * 0}
    ckpt = Checkpointer(store, run=f"phases-{publisher}-{bool(memory)}", publisher=publisher,
                        memory=memory, durable_every=1 if memory else None)
    done = ckpt.save(state, update=1)
    out = {"phases": dict(done.phases), "seconds": done.stats["seconds"], "is_str": isinstance(done, str),
           "same": dict(done.phases) == dict(ckpt.last_save["phases"])}
    for view in (done.stats, done.phases, ckpt.last_save):
        try:
            view["root"] = "changed"
            out["writable"] = True
        except TypeError:
            out.setdefault("writable", False)
    ckpt.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("publisher, memory", [("star", False), ("tree", False), ("star", True)])
def test_a_save_says_where_its_time_went_phase_by_phase_and_its_stats_are_read_only(tmp_path, publisher, memory):
    memory_dir = str(tmp_path / "holders") if memory else None
    results = run_ranks(2, save_and_read_phases, str(tmp_path / "s"), publisher, memory_dir, tmp=tmp_path)
    for r in results:
        expected = {"capture", "agree", "durable.write", "durable.commit"}
        if memory:
            expected |= {"memory.write", "memory.commit", "memory.replicate"}
        assert set(r["phases"]) == expected
        assert all(s >= 0 for s in r["phases"].values())
        assert sum(v for k, v in r["phases"].items() if k != "capture") <= r["seconds"] + 0.05
        assert r["same"] and not r["writable"] and not r["is_str"]
