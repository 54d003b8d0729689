"""The product's test hooks: a default that changes nothing, and fault points only where a process installs them."""
import inspect
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import alpha_ckpt
from alpha_ckpt.runtime import hooks
from alpha_ckpt.tiers.durable.tree import TreeRole
from alpha_ckpt.store import Store
from alpha_ckpt.runtime.faults import FaultHooks, installed
from alpha_ckpt.generation.writer import publish_slices

PACKAGE = pathlib.Path(alpha_ckpt.__file__).parent


def test_the_default_hooks_pass_every_message_on_and_act_at_no_point():
    assert hooks.installed() is hooks.NO_HOOKS
    message = {"kind": "commit", "role": 3}
    assert hooks.installed().tamper(3, message) is message
    assert hooks.installed().fault("object", "before-rename") is None
    assert hooks.installed().after_update(0, 1) is None


def test_installed_hooks_are_called_and_the_previous_ones_come_back():
    seen = []
    with installed(FaultHooks(lambda kind, point: seen.append((kind, point)), tree_faults={2: "withhold-commit"})):
        hooks.fault_point("ref", "after-rename")
        assert hooks.installed().tamper(2, {"kind": "commit"}) is None
        assert hooks.installed().tamper(1, {"kind": "commit"}) == {"kind": "commit"}
    assert seen == [("ref", "after-rename")]
    assert hooks.installed() is hooks.NO_HOOKS


def test_no_product_signature_takes_a_test_only_argument():
    for function, gone in ((publish_slices, "forged"), (Store.publish_ref, "fence"), (TreeRole.__init__, "tamper")):
        assert gone not in inspect.signature(function).parameters, (function.__qualname__, gone)


def test_only_the_fault_points_module_reads_the_fault_variables():
    names = ("ALPHA_CKPT_FAULT", "ALPHA_CKPT_KILL_OWNER", "ALPHA_CKPT_TREE_FAULT")
    readers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if any(name in path.read_text() for name in names))
    assert readers == ["runtime/faults.py"]


@pytest.mark.timeout(60)
def test_a_process_that_installs_no_hooks_is_not_killed_by_the_fault_variable(tmp_path):
    # The library never reads ALPHA_CKPT_FAULT itself: only a process that installs the
    # environment's hooks as it starts (alpha-run's ranks, the job's owners, alpha-ckpt) dies there.
    (tmp_path / "tmp").mkdir()
    (tmp_path / "dest").mkdir()
    script = textwrap.dedent("""
        import os, sys
        from alpha_ckpt.store import durable
        root = sys.argv[1]
        tmp = os.open(os.path.join(root, "tmp"), os.O_RDONLY | os.O_DIRECTORY)
        dest = os.open(os.path.join(root, "dest"), os.O_RDONLY | os.O_DIRECTORY)
        durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=lambda fd: os.write(fd, b"x") and None,
                               name="a", kind="object")
        print("returned")
    """)
    env = dict(os.environ, ALPHA_CKPT_FAULT="object:before-rename")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, timeout=50)
    assert proc.returncode == 0 and b"returned" in proc.stdout
    assert os.listdir(tmp_path / "dest") == ["a"]
