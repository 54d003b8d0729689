"""The store's directory layout has one owner: alpha_ckpt/store/layout.py.

No module outside alpha_ckpt/store/ joins names onto a store's root, nor names one of the store's own
directories to a file-system call: each asks ``store.layout`` (a :class:`StoreLayout`) instead.
"""
from __future__ import annotations

import ast
import os
import pathlib

import pytest

import alpha_ckpt
from alpha_ckpt.errors import Refusal
from alpha_ckpt.store import Store, StoreLayout
from alpha_ckpt.store import layout as L

PACKAGE = pathlib.Path(alpha_ckpt.__file__).parent
STORE_PACKAGE = PACKAGE / "store"
DIRECTORY_NAMES = {L.OBJECTS, L.REFS, L.TMP, L.OUTPUTS, L.PENDING, L.QUARANTINE, L.PINS, L.VERIFIED}
FS_CALLS = {"open", "stat", "lstat", "listdir", "scandir", "mkdir", "makedirs", "unlink", "rmdir", "rename",
            "replace", "utime", "join", "make_dir_durable", "make_dirs_durable", "durable_commit", "Path"}


def _is_root(node: ast.AST) -> bool:
    """``something.root`` where something names a store, or a variable named ``store_root``."""
    if isinstance(node, ast.Attribute) and node.attr == "root":
        base = node.value
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        return "store" in name.lower()
    return isinstance(node, ast.Name) and node.id == "store_root"


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def layout_violations(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _is_root(node.left):
            out.append(f"{where}: a path joined onto a store's root with /")
        elif isinstance(node, ast.JoinedStr):
            parts = node.values
            for a, b in zip(parts, parts[1:]):
                if isinstance(a, ast.FormattedValue) and _is_root(a.value) \
                        and isinstance(b, ast.Constant) and str(b.value).startswith("/"):
                    out.append(f"{where}: a path formatted onto a store's root")
        elif isinstance(node, ast.Call) and _call_name(node) in FS_CALLS:
            args = list(node.args) + [k.value for k in node.keywords if k.arg != "kind"]  # kind: a fault point's label
            if _call_name(node) == "join" and args and _is_root(args[0]):
                out.append(f"{where}: os.path.join onto a store's root")
            for arg in args:
                if isinstance(arg, ast.Constant) and arg.value in DIRECTORY_NAMES:
                    out.append(f"{where}: the store directory {arg.value!r} named outside the layout")
                if isinstance(arg, (ast.Tuple, ast.List)) and any(
                        isinstance(e, ast.Constant) and e.value in DIRECTORY_NAMES for e in arg.elts):
                    out.append(f"{where}: store directories named outside the layout")
    return out


def test_no_module_outside_the_store_package_builds_paths_under_a_store_root():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if STORE_PACKAGE not in path.parents:
            found += layout_violations(path)
    assert not found, "ask store.layout instead:\n" + "\n".join(found)


def test_the_checker_sees_each_way_of_building_a_store_path(tmp_path):
    sample = tmp_path / "sample.py"  # parsed only, never imported
    code = ("import os\n"
            "a = os.path.join(store.root, 'x')\n"
            "b = self.store.root / 'y'\n"
            "c = f'{store.root}/refs'\n"
            "d = os.open('tmp', 0, dir_fd=3)\n"
            "e = make_dirs_durable(fd, ('objects', 'refs'))\n"
            "f = os.stat(store.root)\n")  # the root itself is no path under it
    sample.write_text(code)
    assert len(layout_violations(sample)) == 5


def test_the_layout_names_where_a_store_keeps_each_thing(tmp_path):
    with Store(tmp_path / "s") as store:
        layout = store.layout
        assert isinstance(layout, StoreLayout)
        digest = "ab" + "0" * 62
        assert layout.object_path(digest) == os.path.join(store.root, "objects", "ab", digest)
        assert layout.ref_path("r", "s", 7) == os.path.join(store.root, "refs", "r", "s", "0000000007")
        for name in L.CREATED:  # a created store has each, as a plain directory
            assert os.path.isdir(layout.path(name)) and not os.path.islink(layout.path(name))
        assert {layout.tmp_dir(), layout.pending_dir(), layout.quarantine_dir(), layout.pins_dir(),
                layout.verified_dir(), layout.outputs_dir("r", "s")} == {
            os.path.join(store.root, n) for n in ("tmp", "pending", "quarantine", "pins", "verified", "outputs/r/s")}


# Modules outside the store package that still open a store's directories themselves, each with why (none).
OPENS_STORE_DIRECTORIES: dict[str, str] = {}


def test_no_module_outside_the_store_package_opens_a_stores_directories():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if STORE_PACKAGE in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("open_root", "open_dir") \
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "layout":
                found.add(path.relative_to(PACKAGE.parent).as_posix())
    assert found == set(OPENS_STORE_DIRECTORIES), \
        "only the store package opens a store's directories (ask the Store or its backend)"


def test_an_output_is_published_once_under_its_run_and_step_and_a_second_put_keeps_the_first(tmp_path):
    with Store(tmp_path / "s") as store:
        path = store.put_output("r", "s", "model-ab.safetensors", b"fitted")
        assert path == os.path.abspath(store.layout.output_path("r", "s", "model-ab.safetensors"))
        assert store.put_output("r", "s", "model-ab.safetensors", b"fitted") == path
        with open(path, "rb") as f:
            assert f.read() == b"fitted"
        assert os.listdir(store.layout.tmp_dir()) == []
        with pytest.raises(Refusal):
            store.put_output("r", "s", "../escape", b"x")
