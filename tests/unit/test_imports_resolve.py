"""Every name the gates, the bench tool, examples and tests import from alpha_ckpt exists: a module moved
inside the package breaks a gate at once here, not after the test suite in CI."""
import ast
import importlib
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _is_python(path: pathlib.Path) -> bool:
    """A .py file, or a gate: a file in gates/ without a suffix whose first line runs python."""
    if path.suffix == ".py":
        return True
    if path.parent.name != "gates" or path.suffix:
        return False
    with open(path, "rb") as f:
        first = f.readline()
    return first.startswith(b"#!") and b"python" in first


def _sources():
    for folder in ("gates", "bench", "examples", "tests", "alpha_ckpt"):
        yield from (p for p in sorted((REPO / folder).rglob("*")) if p.is_file() and _is_python(p))


def _unresolved(path: pathlib.Path) -> list[str]:
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("alpha_ckpt"):
            try:
                module = importlib.import_module(node.module)
            except ImportError:
                missing.append(node.module)
                continue
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        missing.append(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("alpha_ckpt"):
                    try:
                        importlib.import_module(alias.name)
                    except ImportError:
                        missing.append(alias.name)
    return missing


def test_every_alpha_ckpt_import_of_the_gates_bench_examples_and_tests_resolves():
    sources = list(_sources())
    assert any(p.parent.name == "gates" for p in sources) and any(p.parent.name == "bench" for p in sources)
    missing = {str(p.relative_to(REPO)): m for p in sources if (m := _unresolved(p))}
    assert missing == {}


def test_a_moved_module_is_caught(tmp_path):
    script = tmp_path / "gates" / "gate"
    script.parent.mkdir()
    script.write_text("#!/usr/bin/env python3\nfrom alpha_ckpt.leases import CLOCK_SLACK_S\nfrom alpha_ckpt.store import Nope\n")
    assert _is_python(script) and _unresolved(script) == ["alpha_ckpt.leases", "alpha_ckpt.store.Nope"]
