"""The package's import graph: no cycle, and every module imports only from its own layer or lower ones.

Every import counts, at module level or inside a function, relative or absolute: an import deferred
into a function still makes the lower layer depend on the higher one. Importing ``a.b.c`` also runs
the package ``a.b``'s ``__init__``, so that is an edge too (except from inside ``a.b`` itself).
"""
from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import alpha_ckpt

PACKAGE = pathlib.Path(alpha_ckpt.__file__).parent
ROOT = "alpha_ckpt"

# Bottom to top: each package (or top-level module) is one layer and may import its own layer and lower ones.
LAYERS: dict[int, tuple[str, str]] = {
    0: ("errors", "the refusals and errors every layer raises (torch-free)"),
    1: ("format", "bytes only: records, decoding, typed values, canonical JSON, structural checks (no torch, no numpy)"),
    2: ("runtime", "what a process of a job reads and does about its own life, torch-free at import: the launch "
                   "environment (the one reader of ALPHA_CKPT_*), schedules, hooks and fault points, heartbeat, "
                   "lifeline, progress, a clean exit"),
    3: ("store", "the layout, the storage backend, objects, refs, write modes and leases of a store; the one durable commit"),
    4: ("state", "what a state may hold: capture, regions and their checks, load, numerics, placement, the device"),
    5: ("generation", "plan, pack, hash, write, open, read, payloads, destinations, async save"),
    6: ("upkeep", "store maintenance over whole generations: completeness, pins, gc, export"),
    7: ("tiers", "how the owners' captures become one generation: the durable tier's publishers, the memory tier"),
    8: ("collective", "the Checkpointer of any torch.distributed group"),
    9: ("api", "the one-process API"),
    10: ("dcp", "DCP's StorageWriter and StorageReader over a store"),
    11: ("launch", "where a process starts: alpha-run, alpha-ckpt, a script's rank, in-place rounds, resilient"),
    12: ("job", "the built-in forecasting job and its learner: a client of the library"),
    13: ("testing", "test support: forged generations, the tree's simulation, the oracle, the one launch harness"),
    14: ("", "the package's public names (re-exported on first use)"),
}

# Edges that break the contract today, each with why it is still there. Empty is the goal.
ALLOWED: dict[tuple[str, str], str] = {}  # upward imports allowed, each with its reason (none)


def _name(path: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join([ROOT, *parts]), is_package


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name, is_package = _name(path)
        out[name] = (path, is_package)
    return out


def _within(name: str, modules) -> str | None:
    """The longest prefix of ``name`` that is one of the package's modules."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module: line of the first import}, for the package's own modules only."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in modules.items():
        package = module.split(".") if is_package else module.split(".")[:-1]
        targets: dict[str, int] = {}

        def add(target: str | None, line: int) -> None:
            if target is None or target == module:
                return
            targets.setdefault(target, line)
            parent = target.rpartition(".")[0]
            while parent and parent != ROOT:  # the package's __init__ runs first
                if not (module == parent or module.startswith(parent + ".")):
                    targets.setdefault(parent, line)
                parent = parent.rpartition(".")[0]

        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(_within(alias.name, modules), node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    add(submodule if submodule in modules else _within(source, modules), node.lineno)
        graph[module] = targets
    return graph


def _package(module: str) -> str:
    """The layer's name of a module: its package (or top-level module) under alpha_ckpt; "" for alpha_ckpt."""
    return module.split(".")[1] if "." in module else ""


def _layer_of() -> dict[str, int]:
    """Every module of the package -> its layer (the layer of its package)."""
    by_name = {name: layer for layer, (name, _) in LAYERS.items()}
    return {m: by_name[_package(m)] for m in import_graph() if _package(m) in by_name}


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_sees_relative_absolute_and_function_level_imports():
    graph = import_graph()
    assert f"{ROOT}.errors" in graph[f"{ROOT}.format.records"]  # from alpha_ckpt.errors import ... (module level)
    assert f"{ROOT}.state.placement" in graph[f"{ROOT}.state.capture"]  # from .placement import ... (in a function)
    assert f"{ROOT}.state" in graph[f"{ROOT}.collective"]  # from ..state.placement: the package's __init__ runs


def test_the_package_imports_have_no_cycle():
    graph = {m: {t: line for t, line in targets.items() if (m, t) not in ALLOWED} for m, targets in import_graph().items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_every_module_has_a_layer():
    layer_of = _layer_of()
    missing = sorted(set(import_graph()) - set(layer_of))
    assert not missing, f"modules with no layer in LAYERS: {missing}"
    gone = sorted({name for name, _ in LAYERS.values()} - {_package(m) for m in import_graph()})
    assert not gone, f"LAYERS names packages that do not exist: {gone}"


def test_the_package_is_a_short_list_of_layers():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 15, entries
    assert {p.removesuffix(".py") for p in entries} == {name or "__init__" for name, _ in LAYERS.values()}


def test_the_format_layer_imports_neither_torch_nor_numpy():
    found = []
    for path in sorted((PACKAGE / "format").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("torch", "numpy")]
    assert not found, found


def test_every_module_imports_only_its_own_layer_or_lower_ones():
    layer_of = _layer_of()
    upward = []
    for module, targets in sorted(import_graph().items()):
        for target, line in sorted(targets.items()):
            if module in layer_of and target in layer_of and layer_of[target] > layer_of[module] \
                    and (module, target) not in ALLOWED:
                upward.append(f"{module} (layer {layer_of[module]}) imports {target} (layer {layer_of[target]}) "
                              f"at line {line}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_every_allowed_exception_is_still_needed():
    graph = import_graph()
    stale = [edge for edge in ALLOWED if edge[1] not in graph.get(edge[0], {})]
    assert not stale, f"ALLOWED names edges the package no longer has: {stale}"


@pytest.mark.timeout(120)
def test_importing_each_layer_loads_no_module_of_a_higher_one():
    # At run time too (importlib, re-exports): import the layers bottom-up in a fresh process and,
    # after each, look at what is loaded. The collective layer thus loads neither the job, its
    # learner, the test hooks nor alpha-run.
    layer_of = _layer_of()
    layers = [sorted(m for m, n in layer_of.items() if n == layer) for layer in sorted(LAYERS)]
    code = ("import importlib, json, sys\n"
            f"layers = {layers!r}\n"
            "seen = []\n"
            "for modules in layers[:-1]:\n"
            "    for m in modules:\n"
            "        importlib.import_module(m)\n"
            "    seen.append(sorted(m for m in sys.modules if m.startswith('alpha_ckpt.')))\n"
            "print(json.dumps(seen))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # What an ALLOWED edge loads (and what that loads in turn) is its listed exception, not a new one.
    excepted = {layer: {_package(target) for source, target in ALLOWED if layer_of[source] <= layer}
                for layer in LAYERS}
    for layer, loaded in enumerate(json.loads(proc.stdout)):
        above = [m for m in loaded if layer_of.get(m, 0) > layer and _package(m) not in excepted[layer]]
        assert not above, f"importing layers 0..{layer} loaded {above}"


# The launcher's protocol with its processes lives in one module; test support reads its own variables.
PROTOCOL = {"runtime/launch_env.py"}
# Test support: the fault points a test asks for (read from the environment) and the test-only package.
TEST_SUPPORT = {"runtime/faults.py"}
# Reads or writes of os.environ besides those, each with why.
ENVIRONMENT_ALLOWED = {
    "job/owner.py": "LOCAL_RANK: torchrun's variable, which picks the owner's device",
    "job/learner/model.py": "CUBLAS_WORKSPACE_CONFIG: cuBLAS's own, set before CUDA starts for deterministic kernels",
}
# Modules that name ALPHA_CKPT_ variables besides the protocol's, each with why (none).
PREFIX_ALLOWED: dict[str, str] = {}


def _product_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("testing/") or relative in PROTOCOL or relative in TEST_SUPPORT:
            continue
        yield relative, path.read_text()


def test_only_the_launcher_protocol_module_and_test_support_name_alpha_ckpt_variables():
    named = [relative for relative, text in _product_sources() if "ALPHA_CKPT_" in text and relative not in PREFIX_ALLOWED]
    assert not named, f"ALPHA_CKPT_ outside alpha_ckpt/runtime/launch_env.py and alpha_ckpt/testing/: {named}"


def _environment_uses(text: str) -> list[int]:
    """Lines that touch the process environment: os.environ, os.getenv, os.putenv, os.unsetenv, environ imported."""
    lines = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv", "environb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and \
                any(a.name in ("environ", "getenv", "putenv", "unsetenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_the_environment_is_read_only_by_the_launcher_protocol_module_test_support_and_a_listed_few():
    found = {relative: lines for relative, text in _product_sources()
             if (lines := _environment_uses(text)) and relative not in ENVIRONMENT_ALLOWED}
    assert not found, f"os.environ outside alpha_ckpt/runtime/launch_env.py and alpha_ckpt/testing/: {found}"
    stale = [relative for relative in ENVIRONMENT_ALLOWED if not _environment_uses((PACKAGE / relative).read_text())]
    assert not stale, f"ENVIRONMENT_ALLOWED names modules that no longer touch the environment: {stale}"


def test_the_job_reaches_into_no_private_attribute_of_its_checkpointer():
    private = []
    for path in sorted((PACKAGE / "job").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name == "ckpt":
                    private.append(f"{path.name}:{node.lineno} ckpt.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module and "collective" in node.module and \
                    any(a.name.startswith("_") for a in node.names):
                private.append(f"{path.name}:{node.lineno} imports a private name of {node.module}")
    assert not private, f"the job uses the Checkpointer's private parts: {private}"
