"""Each option spelled once: one added to the options' core reaches alpha-run's flag, the hand-off to the
ranks and the Checkpointer; the flags and the keywords are checked by the same rules."""
import json
import os
import re

import pytest

from alpha_ckpt import Checkpointer, CheckpointerOptions, UsageError
from alpha_ckpt.launch import launcher
from alpha_ckpt.runtime import launch_env
from alpha_ckpt.runtime import options as options_core
from alpha_ckpt.state.rules import METADATA_KEY
from ranks import run_ranks


def _probe_option() -> options_core.Option:
    """An option added in the core only: a whole number of at least 1, alpha-run's --probe-depth."""
    return options_core.Option("probe_depth", 2, "A probe's depth.", options_core.whole_at_least(1),
                               flag="--probe-depth", parse=int)


@pytest.fixture
def one_more_option(monkeypatch):
    monkeypatch.setattr(options_core, "OPTIONS", options_core.OPTIONS + (_probe_option(),))


def _launched(tmp_path, *flags):
    return launcher.parse(["--nproc", "2", "--store", str(tmp_path / "s"), "--run", "r", *flags,
                           str(tmp_path / "train.py")])


def open_and_read_option(rank, world, store):
    options_core.OPTIONS += (_probe_option(),)  # this rank's process: added in the core, nowhere else
    ckpt = Checkpointer(store, run="r", probe_depth=5)
    depth = ckpt.options.probe_depth
    ckpt.close()
    return depth


def test_an_option_added_to_the_core_reaches_the_flag_the_hand_off_and_the_checkpointer(
        tmp_path, monkeypatch, one_more_option):
    args = _launched(tmp_path, "--probe-depth", "7")
    assert "--probe-depth" in launcher.parser().format_help()
    for name, value in launcher.script_environment(args).items():  # what alpha-run's ranks get
        monkeypatch.setenv(name, value)
    assert json.loads(os.environ[launch_env.OPTIONS])["probe_depth"] == 7  # one variable, the option in it
    assert CheckpointerOptions(**launch_env.launcher_settings()).probe_depth == 7  # from_launcher_env's options
    assert CheckpointerOptions(store="s", run="r").probe_depth == 2  # its default
    with pytest.raises(UsageError) as flag:
        launcher.script_environment(_launched(tmp_path, "--probe-depth", "0"))
    assert "--probe-depth" in str(flag.value)
    with pytest.raises(UsageError) as keyword:
        CheckpointerOptions(store="s", run="r", probe_depth=0)
    assert "probe_depth=" in str(keyword.value)
    assert run_ranks(2, open_and_read_option, str(tmp_path / "s"), tmp=tmp_path) == [5, 5]  # a keyword argument


def test_without_the_added_option_the_checkpointer_refuses_it_as_unknown(tmp_path):
    with pytest.raises(UsageError) as unknown:
        CheckpointerOptions(store="s", run="r", probe_depth=5)
    assert "probe_depth" in str(unknown.value)


@pytest.mark.parametrize("given, flags", [
    ({"every": "auto"}, ["--checkpoint-every", "auto"]),
    ({"every": 3, "checkpoint_cost": "60"}, ["--checkpoint-every", "3", "--checkpoint-cost", "60"]),
    ({"replicas": 2}, ["--replicas", "2"]),
    ({"durable_every": 3}, ["--durable-every", "3"]),
    ({"fanout": 0}, ["--fanout", "0"]),
    ({"commit_timeout": -1.0}, ["--commit-timeout", "-1"]),
    ({"memory": True, "mtbf_durable": "30d", "durable_every": 2, "every": "auto", "mtbf": "6h"},
     ["--memory", "--mtbf-durable", "30d", "--durable-every", "2", "--checkpoint-every", "auto", "--mtbf", "6h"]),
])
def test_a_flag_and_its_keyword_are_refused_by_the_same_rule_each_spelled_as_its_caller_spells_it(
        tmp_path, given, flags):
    with pytest.raises(UsageError) as keyword:
        CheckpointerOptions(store="s", run="r", **given)
    with pytest.raises(UsageError) as flag:
        launcher.script_environment(_launched(tmp_path, *flags))
    spelled = {o.name: o.flag for o in options_core.OPTIONS if o.flag}
    words = str(keyword.value)
    for name, spelling in spelled.items():  # every='auto' is --checkpoint-every auto; \b: not durable_every=
        words = re.sub(rf"\b{name}=(?:'([^']*)')?",
                       lambda m, s=spelling: s + (f" {m.group(1)}" if m.group(1) else ""), words)
    assert str(flag.value) == words.removeprefix("Checkpointer: ")


def test_every_option_has_a_default_a_meaning_and_a_rule_and_flags_are_unique():
    names = [o.name for o in options_core.OPTIONS]
    assert len(names) == len(set(names))
    flags = [o.flag for o in options_core.OPTIONS if o.flag]
    assert len(flags) == len(set(flags))
    assert all(o.doc and o.check is not None for o in options_core.OPTIONS)
    assert options_core.check({}) == options_core.defaults()


def test_what_a_root_manifest_records_of_its_own_is_named_where_the_placement_rules_name_it():
    assert METADATA_KEY in options_core.RECORDED_METADATA


def test_the_options_core_imports_neither_torch_nor_numpy():
    import subprocess
    import sys
    code = ("import sys; import alpha_ckpt.runtime.options, alpha_ckpt.runtime.launch_env; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def test_options_are_read_only_and_replace_checks_again():
    options = CheckpointerOptions(store="s", run="r", fanout=3)
    with pytest.raises(AttributeError):
        options.fanout = 4
    assert options.replace(fanout=4).fanout == 4 and options.fanout == 3
    with pytest.raises(UsageError):
        options.replace(fanout=0)
