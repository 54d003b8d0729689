"""Each test folder holds one kind of test (docs/TESTING.md): tests/unit runs in the test's own process (a
single helper process at most, never a process group), tests/distributed starts ranks that form a
torch.distributed process group, tests/e2e runs alpha-run. A file's kind is read from its source: the names
and programs through which it starts such processes."""
from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# Ranks of a process group: the harness's ranks, torch's launcher, multiprocessing's spawn.
RANK_NAMES = {"run_ranks", "torchrun"}
RANK_CALLS = {"init_process_group", "spawn", "start_processes"}
RANK_MODULES = {"ranks"}  # tests/ranks.py: run_ranks for tests
RANK_PROGRAMS = {"torch.distributed.run"}
# alpha-run, forked from the harness's server, as a new interpreter or as the console script.
ALPHA_RUN_NAMES = {"alpha_run", "alpha_run_start", "alpha_run_command"}
ALPHA_RUN_PROGRAMS = {"alpha_ckpt.launch.launcher", "alpha-run"}
BENCH_PROGRAM = "bench"  # python -m bench: a test running it as a program runs a suite's ranks

def _found(tree: ast.AST, helpers: dict[str, dict[str, set[str]]]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {"process group": set(), "alpha-run": set()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names = {node.id}
        elif isinstance(node, ast.Attribute):
            names = {node.attr}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = {node.name}
        elif isinstance(node, ast.alias):
            names = {node.name, node.asname} - {None}
        else:
            names = set()
        found["process group"] |= names & RANK_NAMES
        found["alpha-run"] |= names & ALPHA_RUN_NAMES
        modules = {node.module} if isinstance(node, ast.ImportFrom) else \
            {a.name for a in node.names} if isinstance(node, ast.Import) else set()
        found["process group"] |= modules & RANK_MODULES
        if isinstance(node, ast.Call):
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called in RANK_CALLS:
                found["process group"].add(called)
            # the bench tool run as a program: its multi-rank suites start the ranks
            if called in ("python_m", "python_m_start") and node.args and \
                    isinstance(node.args[0], ast.Constant) and node.args[0].value == BENCH_PROGRAM:
                found["process group"].add(BENCH_PROGRAM)
        if isinstance(node, ast.List):
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            if any(a == "-m" and b == BENCH_PROGRAM for a, b in zip(words, words[1:])):
                found["process group"].add(BENCH_PROGRAM)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in RANK_PROGRAMS or "init_process_group(" in node.value:  # a child's program
                found["process group"].add(node.value if node.value in RANK_PROGRAMS else "init_process_group(")
            if node.value in ALPHA_RUN_PROGRAMS:
                found["alpha-run"].add(node.value)
        # A function of a helper module (tests/*.py) that starts them, imported by name or called as module.name.
        used = [(node.module, a.name) for a in node.names] if isinstance(node, ast.ImportFrom) else \
            [(node.value.id, node.attr)] if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) else []
        for module, name in used:
            for kind in helpers.get(module, {}).get(name, ()):
                found[kind].add(f"{module}.{name}")
    return found


def helper_launches(source: str) -> dict[str, set[str]]:
    """The top-level functions of a helper module that start ranks or alpha-run, themselves or through another
    of its functions: {function: kinds}."""
    functions = {node.name: node for node in ast.parse(source).body
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    kinds = {name: {kind for kind, names in _found(node, {}).items() if names} for name, node in functions.items()}
    grown = True
    while grown:
        grown = False
        for name, node in functions.items():
            calls = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in functions} - {name}
            more = set().union(*(kinds[c] for c in calls)) - kinds[name]
            if more:
                kinds[name] |= more
                grown = True
    return {name: found for name, found in kinds.items() if found}


@functools.cache
def helper_modules() -> dict[str, dict[str, set[str]]]:
    """Every helper module of tests/ by name: its functions that start ranks or alpha-run."""
    return {path.stem: helper_launches(path.read_text()) for path in sorted(TESTS.glob("*.py"))
            if path.name != "conftest.py"}


def launches(source: str, helpers: dict[str, dict[str, set[str]]] | None = None) -> dict[str, list[str]]:
    """What ``source`` starts beyond its own process: {"process group": [...], "alpha-run": [...]}, each the
    names and programs found (an empty dict for an in-process test); ``helpers``: tests/'s by default."""
    found = _found(ast.parse(source), helper_modules() if helpers is None else helpers)
    return {kind: sorted(names) for kind, names in found.items() if names}


def _files(folder: str) -> list[Path]:
    return sorted((TESTS / folder).rglob("*.py"))


def test_every_file_under_tests_unit_runs_in_process():
    flagged = {str(path.relative_to(TESTS)): launches(path.read_text()) for path in _files("unit")
               if path != Path(__file__).resolve()}  # not its samples
    assert {path: kinds for path, kinds in flagged.items() if kinds} == {}, (
        "a test that starts a process group belongs in tests/distributed, one that runs alpha-run in tests/e2e")


def test_every_file_under_tests_distributed_starts_a_process_group_and_none_runs_alpha_run():
    kinds = {str(path.relative_to(TESTS)): launches(path.read_text()) for path in _files("distributed")}
    assert kinds, "tests/distributed holds no test"
    assert [path for path, found in kinds.items() if "process group" not in found] == [], "in-process: tests/unit"
    assert [path for path, found in kinds.items() if "alpha-run" in found] == [], "runs alpha-run: tests/e2e"


@pytest.mark.parametrize("source, kind", [
    ("from ranks import run_ranks\ndef test_x(tmp_path):\n    run_ranks(2, f, tmp=tmp_path)\n", "process group"),
    ("from alpha_ckpt.testing.launch import run_ranks as on_ranks\n", "process group"),
    ("import ranks\nranks.run_ranks(2, f, tmp=t)\n", "process group"),
    ("from alpha_ckpt.testing import launch\nlaunch.python_m('bench', 'sharded', '--reps', '1')\n", "process group"),
    ("import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'bench', 'recovery', '--quick'])\n",
     "process group"),
    ("import torch.multiprocessing as mp\ndef test_x():\n    mp.spawn(f, nprocs=2)\n", "process group"),
    ("import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'torch.distributed.run', 's.py'])\n",
     "process group"),
    ("from alpha_ckpt.testing import launch\nlaunch.torchrun('s.py', 2)\n", "process group"),
    ("from alpha_ckpt.testing import launch\n"
     "launch.python_c('import torch.distributed as dist; dist.init_process_group(\"gloo\")')\n", "process group"),
    ("from alpha_ckpt.testing import launch\nlaunch.alpha_run('--nproc', 2, 's.py')\n", "alpha-run"),
    ("from alpha_ckpt.testing.launch import alpha_run_start\n", "alpha-run"),
    ("import subprocess\nsubprocess.run(['alpha-run', '--nproc', '2', 's.py'])\n", "alpha-run"),
    ("from alpha_ckpt.testing import launch\nlaunch.python_m('alpha_ckpt.launch.launcher', '--nproc', 2)\n",
     "alpha-run"),
], ids=["run-ranks", "run-ranks-renamed", "ranks-module", "bench-suite", "bench-suite-program", "mp-spawn", "torchrun-module", "harness-torchrun",
        "child-program-with-a-group", "alpha-run", "alpha-run-start", "alpha-run-console", "alpha-run-module"])
def test_the_detector_finds_each_way_of_starting_ranks_or_alpha_run(source, kind):
    assert kind in launches(source)


@pytest.mark.parametrize("source", [
    "from alpha_ckpt.testing import launch\nlaunch.alpha_run_checks('--nproc', 2, '--fanout', 0, 'c.toml')\n",
    "from alpha_ckpt.testing import launch\nlaunch.python_c('import sys; sys.exit(3)')\n",
    "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'alpha_ckpt.launch.cli', 'verify'])\n",
    "import torch\ndef test_x(monkeypatch):\n"
    "    monkeypatch.setattr(torch.distributed, 'init_process_group', lambda *a: None)\n",
    "def test_x(capsys):\n    assert 'alpha-run: exit 2' in capsys.readouterr().err\n",
    "from alpha_ckpt.testing import launch\nlaunch.in_fresh_process(f, 1)\n",
    "ranks = [0, 1]\nassert len(ranks) == 2\n",
    "record = {'bench': ['tree']}\nassert record['bench'] == ['tree']\n",
], ids=["alpha-run-checks", "one-python-process", "alpha-ckpt-cli", "stubbed-init", "alpha-run-in-a-message",
        "one-fresh-process", "a-variable-named-ranks", "the-word-bench"])
def test_the_detector_passes_in_process_tests(source):
    assert launches(source) == {}


def test_files_that_were_moved_out_of_tests_unit_are_found_by_the_detector():
    # The control on real files: were one of these back under tests/unit, the first test would fail.
    assert "process group" in launches((TESTS / "distributed" / "test_star_race.py").read_text())
    assert "process group" in launches(  # through tests/state_recipes.py
        (TESTS / "distributed" / "test_publish_implies_restore_examples.py").read_text())
    assert "alpha-run" in launches((TESTS / "e2e" / "test_dcp_under_alpha_run.py").read_text())
    assert "alpha-run" in launches((TESTS / "e2e" / "test_readme.py").read_text())


def test_a_source_with_a_program_string_is_read_as_what_it_starts():
    child = textwrap.dedent('''
        SCRIPT = """
        import torch.distributed as dist
        dist.init_process_group("gloo")
        """
    ''')
    assert launches(child) == {"process group": ["init_process_group("]}


def test_a_helper_function_that_starts_ranks_makes_a_test_that_uses_it_start_them():
    helper = textwrap.dedent("""
        def _save(world, tmp):
            from ranks import run_ranks
            return run_ranks(world, print, tmp=tmp)
        def check(recipe, tmp):
            return _save(2, tmp)
        def encode(value):
            return value
    """)
    helpers = {"recipes": helper_launches(helper)}
    assert helpers == {"recipes": {"_save": {"process group"}, "check": {"process group"}}}
    assert launches("from recipes import check\n", helpers) == {"process group": ["recipes.check"]}
    assert launches("import recipes\nrecipes.check({}, '.')\n", helpers) == {"process group": ["recipes.check"]}
    assert launches("from recipes import encode\n", helpers) == {}
    # The real one: the recipes the publish-implies-restore examples check are saved on ranks.
    assert helper_modules()["state_recipes"]["check_recipe"] == {"process group"}
