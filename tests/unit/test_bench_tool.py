"""The one benchmark tool: every suite runs by name through one runner, its record names the code and the
machine, and no suite patches anything in alpha_ckpt (figures come from what the product reports)."""
import ast
import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the bench package lives at the repository's root
    sys.path.insert(0, str(ROOT))

from bench.__main__ import SUITES, main as bench_main  # noqa: E402

PATCHERS = {"setattr", "delattr"}


def product_patches(source: str) -> list[str]:
    """Where ``source`` changes something of alpha_ckpt's at run time: an attribute of a module or object
    imported from alpha_ckpt assigned or deleted, ``setattr``/``delattr`` on anything but ``self``, or any use of a mocking
    library (``unittest.mock``, ``mock.patch``, ``monkeypatch``)."""
    tree = ast.parse(source)
    product: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            product |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] == "alpha_ckpt"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "alpha_ckpt":
            product |= {a.asname or a.name for a in node.names}

    def root(expr) -> str | None:
        while isinstance(expr, (ast.Attribute, ast.Subscript)):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and root(t) in product:
                    found.append(f"line {node.lineno}: assigns {ast.unparse(t)}")
        # setattr/delattr on anything but the object's own self: what it is bound to is not known here
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PATCHERS \
                and not (node.args and root(node.args[0]) == "self"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n.split(".")[0] == "mock" or n.startswith("unittest.mock") or n == "mock" for n in names):
                found.append(f"line {node.lineno}: imports a mocking library")
        if isinstance(node, ast.Name) and node.id == "monkeypatch" or isinstance(node, ast.arg) and \
                node.arg == "monkeypatch" or \
                isinstance(node, ast.Attribute) and node.attr == "patch" and root(node) in {"mock", "unittest"}:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_benchmark_patches_anything_in_alpha_ckpt():
    sources = sorted((ROOT / "bench").rglob("*.py"))
    assert len(sources) >= 10
    found = {str(p.relative_to(ROOT)): f for p in sources if (f := product_patches(p.read_text()))}
    assert found == {}


@pytest.mark.parametrize("source", [
    "import alpha_ckpt.generation.writer as writer\nwriter.validate_object_file = lambda obj, what: None\n",
    "from alpha_ckpt.generation import writer\nwriter.validate_object_file = None\n",
    "import alpha_ckpt.dcp as alpha_dcp\nalpha_dcp.SHARD_BYTES = 1\n",
    "import alpha_ckpt\nalpha_ckpt.store.Store.put_objects = None\n",
    "from alpha_ckpt.store import Store\nsetattr(Store, 'put_objects', None)\n",
    "from alpha_ckpt import dcp\ndel dcp.StorageWriter.finish\n",
    "from alpha_ckpt import dcp\ndcp.SHARD_BYTES += 1\n",
    "import os\nfor owner, name in [(os, 'fsync')]:\n    setattr(owner, name, print)\n",
    "from unittest import mock\n",
    "import unittest.mock\n",
    "def f(monkeypatch):\n    pass\n",
])
def test_the_patch_detector_flags_every_way_of_patching_the_product(source):
    assert product_patches(source)


def test_the_patch_detector_lets_plain_use_of_the_product_and_local_state_pass():
    source = ("import alpha_ckpt\nfrom alpha_ckpt.store import Store\nstore = Store('x')\nstore.close()\n"
              "class Probe:\n    def __init__(self):\n        self.seconds = {}\n"
              "result = alpha_ckpt.save({}, store=store, run='r', step='s', update=1, cursor=0, epoch=0)\n"
              "options = {}\noptions['a'] = result.phases\n")
    assert product_patches(source) == []


def test_without_a_suite_the_runner_lists_every_suite(capsys):
    assert bench_main([]) is None
    listed = capsys.readouterr().out
    assert all(f"  {name} " in listed for name in SUITES)


@pytest.mark.parametrize("argv", [["nosuch"], ["store", "dedup"], ["dedup", "tree"]])
def test_an_unknown_suite_or_a_mix_the_runner_cannot_run_together_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench_main(argv)
    assert stopped.value.code not in (0, None)


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_suite_runs_by_name_and_describes_its_options(name, capsys):
    with pytest.raises(SystemExit) as stopped:
        bench_main([name, "--help"])
    assert stopped.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_a_runs_record_names_its_suite_options_code_and_machine_and_goes_to_out(tmp_path, capsys):
    out = tmp_path / "record.json"
    record = bench_main(["tree", "--owners", "20,40", "--fanout", "4", "--store-dir", str(tmp_path),
                         "--out", str(out)])
    written = json.loads(json.dumps(record))  # as JSON has it: string keys
    assert json.loads(out.read_text()) == written
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == written
    assert record["bench"] == ["tree"] and record["argv"] == ["--owners", "20,40", "--fanout", "4", "--store-dir",
                                                              str(tmp_path)]
    assert len(record["code"]["source_sha256"]) == 16 and record["code"]["version"]
    assert record["machine"]["cpus"] >= 1 and record["machine"]["torch"] and record["machine"]["python"]
    assert [s["owners"] for s in record["result"]["simulations"]] == [20, 40]


SMALL_RUNS = {  # suite: (tiny arguments, what its result must hold)
    "dedup": (["--gib", "0.02", "--reps", "1"], ("median_s", "ratios", "objects_checked")),
    "finite": (["--gib", "0.02", "--reps", "1"], ("median_s", "ratios")),
    "capture": (["--layers", "1", "--width", "16", "--repeats", "1"], ("median_s", "ratios")),
    "write-modes": (["--size-mib", "16", "--reps", "1", "--auto-saves", "1"], ("file_systems",)),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(SMALL_RUNS))
def test_the_one_process_suites_measure_against_their_baseline_and_record_it(name, tmp_path, capsys, monkeypatch):
    args, keys = SMALL_RUNS[name]
    if name == "write-modes":
        args = [*args, "--dirs", str(tmp_path)]
    elif name in ("dedup", "finite"):
        args = [*args, "--dir", str(tmp_path)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    record = bench_main([name, *args])
    assert record["bench"] == [name] and all(k in record["result"] for k in keys)
    ratios = record["result"].get("ratios", {})
    assert all(r > 0 and math.isfinite(r) for r in ratios.values())
    if name == "dedup":  # the re-save validated every object it reused, as the store reported
        assert record["result"]["objects_checked"] >= 1 and record["result"]["checking_s"] > 0


@pytest.mark.slow  # starts a server and rank processes (11 s); CI runs it
@pytest.mark.timeout(240)
def test_the_s3_suite_counts_no_list_on_our_save_and_restore_and_rates_us_against_the_raw_client(tmp_path, monkeypatch):
    # requests counted by the proxy in front of the server, not by the product
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    record = bench_main(["s3", "--ranks", "1,2", "--rounds", "1", "--size-mib", "2", "--methods", "ours", "raw",
                         "--dir", str(tmp_path)])
    worlds = record["result"]["worlds"]
    assert sorted(worlds) == [1, 2]
    for world, figures in worlds.items():
        ours, raw = figures["requests"]["ours"], figures["requests"]["raw"]
        assert ours["save"]["LIST"] == 0 and ours["restore"]["LIST"] == 0, world
        assert ours["save"]["PUT"] >= world and ours["restore"]["GET"] >= world  # a shard per rank at least
        assert raw["save"]["POST"] == 2 * world and raw["restore"]["GET"] == world  # one object per rank
        assert all(r > 0 and math.isfinite(r) for k, r in figures["ratios"].items() if "best peer" not in k)


@pytest.mark.slow  # rank processes (a few seconds); CI runs it
@pytest.mark.timeout(240)
def test_the_replicated_restore_suite_times_every_method_on_the_file_system(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    record = bench_main(["replicated-restore", "--stores", "fs", "--ranks", "2", "--rounds", "2", "--size-mib", "8",
                         "--dir", str(tmp_path)])
    figures = record["result"]["stores"]["fs"]
    assert all(len(figures["times"][m]) == 2 for m in ("shared", "each", "dcp"))
    assert all(r > 0 and math.isfinite(r) for r in figures["speedup"].values())
