"""The one durable-commit function: stages, NOREPLACE, fallback, failures, fault points."""
import errno
import os
import signal
import textwrap
import threading
import time

import pytest

from alpha_ckpt.store import durable
from alpha_ckpt.errors import DurableWriteError
from alpha_ckpt.testing import launch
from alpha_ckpt.runtime.faults import FaultHooks, installed


@pytest.fixture
def dirs(tmp_path):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "dest").mkdir()
    tmp = os.open(tmp_path / "tmp", os.O_RDONLY | os.O_DIRECTORY)
    dest = os.open(tmp_path / "dest", os.O_RDONLY | os.O_DIRECTORY)
    yield tmp_path, tmp, dest
    os.close(tmp)
    os.close(dest)


def _writer(data: bytes):
    def write(fd):
        os.write(fd, data)
    return write


def test_commit_publishes_file_and_leaves_no_temporary(dirs):
    root, tmp, dest = dirs
    name = durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_writer(b"hello"), name="a")
    assert name == "a"
    assert (root / "dest" / "a").read_bytes() == b"hello"
    assert os.listdir(root / "tmp") == []


def test_commit_never_replaces_an_existing_name(dirs):
    root, tmp, dest = dirs
    durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_writer(b"first"), name="a")
    with pytest.raises(FileExistsError):
        durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_writer(b"second"), name="a")
    assert (root / "dest" / "a").read_bytes() == b"first"
    assert os.listdir(root / "tmp") == []


def test_einval_from_renameat2_takes_the_link_fallback_with_noreplace(dirs, monkeypatch):
    root, tmp, dest = dirs
    calls = []

    def no_renameat2(*args):
        calls.append(args)
        raise OSError(errno.EINVAL, "not supported by this file system")

    monkeypatch.setattr(durable._renamer, "renameat2_noreplace", no_renameat2)
    durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_writer(b"x"), name="a")
    assert calls and (root / "dest" / "a").read_bytes() == b"x"
    assert os.listdir(root / "tmp") == []
    with pytest.raises(FileExistsError):
        durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_writer(b"y"), name="a")
    assert (root / "dest" / "a").read_bytes() == b"x"
    assert os.listdir(root / "tmp") == []


def test_other_rename_errors_do_not_take_the_fallback(dirs, monkeypatch):
    root, tmp, dest = dirs

    def eio(*args):
        raise OSError(errno.EIO, "I/O error")

    linked = []
    monkeypatch.setattr(durable._renamer, "renameat2_noreplace", eio)
    monkeypatch.setattr(os, "link", lambda *a, **k: linked.append(a))
    with pytest.raises(DurableWriteError) as info:
        durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_writer(b"x"), name="a")
    assert info.value.stage == "rename" and not linked
    assert os.listdir(root / "dest") == [] and os.listdir(root / "tmp") == []


def test_fsync_failure_is_final_not_retried_and_publishes_nothing(dirs, monkeypatch):
    root, tmp, dest = dirs
    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        raise OSError(errno.EIO, "fsync failed")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(DurableWriteError) as info:
        durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_writer(b"x"), name="a")
    assert info.value.stage == "data-fsync"
    assert len(calls) == 1  # never retried on that descriptor
    assert os.listdir(root / "dest") == [] and os.listdir(root / "tmp") == []


def _write_then_run_out_of_space(fd):
    os.write(fd, b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_enospc_while_writing_removes_the_temporary_file(dirs):
    root, tmp, dest = dirs
    with pytest.raises(DurableWriteError) as info:
        durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_write_then_run_out_of_space, name="a")
    assert info.value.stage == "write"
    assert os.listdir(root / "dest") == [] and os.listdir(root / "tmp") == []


def test_fault_points_fire_in_commit_order(dirs):
    _, tmp, dest = dirs
    seen = []
    with installed(FaultHooks(lambda kind, point: seen.append((kind, point)))):
        durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_writer(b"x"), name="a", kind="ref")
    assert seen == [("ref", p) for p in durable.FAULT_POINTS]


_KILL_SCRIPT = textwrap.dedent("""
    import os, sys
    from alpha_ckpt.store import durable
    from alpha_ckpt.runtime.faults import install_from_environment
    install_from_environment()  # as every process alpha-run starts does
    root = sys.argv[1]
    tmp = os.open(os.path.join(root, "tmp"), os.O_RDONLY | os.O_DIRECTORY)
    dest = os.open(os.path.join(root, "dest"), os.O_RDONLY | os.O_DIRECTORY)
    durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=lambda fd: os.write(fd, b"payload") and None,
                           name="a", kind="object")
    print("returned")
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", durable.FAULT_POINTS)
def test_sigkill_at_each_fault_point_leaves_nothing_or_the_whole_file(dirs, point):
    root, _, _ = dirs
    proc = launch.python_c(_KILL_SCRIPT, root, env=launch.child_env(ALPHA_CKPT_FAULT=f"object:{point}"), timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "returned" not in proc.stdout
    published = os.listdir(root / "dest")
    if point in ("before-data-fsync", "after-data-fsync", "before-rename"):
        assert published == []
    else:
        assert published == ["a"] and (root / "dest" / "a").read_bytes() == b"payload"


@pytest.mark.timeout(60)
def test_fault_for_another_kind_does_not_fire(dirs):
    root, _, _ = dirs
    proc = launch.python_c(_KILL_SCRIPT, root, env=launch.child_env(ALPHA_CKPT_FAULT="ref:before-rename"), timeout=60)
    assert proc.returncode == 0 and "returned" in proc.stdout


def test_a_batch_fsyncs_every_file_before_renaming_any_and_each_directory_once(dirs, monkeypatch):
    root, tmp, dest = dirs
    (root / "other").mkdir()
    other = os.open(root / "other", os.O_RDONLY | os.O_DIRECTORY)
    events = []
    real_fsync, real_rename = os.fsync, durable._renamer.renameat2_noreplace
    dir_ids = {os.fstat(dest).st_ino: "dest", os.fstat(other).st_ino: "other"}
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", dir_ids.get(os.fstat(fd).st_ino, "file"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(durable._renamer, "renameat2_noreplace",
                        lambda *a: (events.append(("rename", a[3])), real_rename(*a))[1])
    try:
        commits = [durable.Commit(_writer(b"a"), dest, "a"), durable.Commit(_writer(b"b"), other, "b"),
                   durable.Commit(_writer(b"c"), dest, "c")]
        assert durable.durable_commit_all(tmp, commits) == ["a", "b", "c"]
    finally:
        os.close(other)
    assert events == [("fsync", "file")] * 3 + [("rename", n) for n in "abc"] + [("fsync", "dest"), ("fsync", "other")]
    assert [(root / d / n).read_bytes() for d, n in (("dest", "a"), ("other", "b"), ("dest", "c"))] == [b"a", b"b", b"c"]
    assert os.listdir(root / "tmp") == []


def test_a_taken_name_in_a_batch_is_reported_and_the_others_published(dirs):
    root, tmp, dest = dirs
    durable.durable_commit(tmp_dir=tmp, dest_dir=dest, write=_writer(b"old"), name="b")
    outcomes = durable.durable_commit_all(tmp, [durable.Commit(_writer(b"a"), dest, "a"),
                                                durable.Commit(_writer(b"new"), dest, "b"),
                                                durable.Commit(_writer(b"c"), dest, "c")])
    assert outcomes[0] == "a" and isinstance(outcomes[1], FileExistsError) and outcomes[2] == "c"
    assert (root / "dest" / "b").read_bytes() == b"old"
    assert sorted(os.listdir(root / "dest")) == ["a", "b", "c"] and os.listdir(root / "tmp") == []


def test_a_failing_write_in_a_batch_publishes_nothing_and_leaves_no_temporary(dirs):
    root, tmp, dest = dirs
    with pytest.raises(DurableWriteError) as info:
        durable.durable_commit_all(tmp, [durable.Commit(_writer(b"a"), dest, "a"),
                                         durable.Commit(_write_then_run_out_of_space, dest, "b")])
    assert info.value.stage == "write"
    assert os.listdir(root / "dest") == [] and os.listdir(root / "tmp") == []


def test_a_batch_with_two_write_threads_writes_two_files_at_once_and_publishes_all_in_order(dirs):
    root, tmp, dest = dirs
    both_writing = threading.Barrier(2, timeout=30)  # broken unless the first two writes overlap

    def meeting_writer(data: bytes):
        def write(fd):
            both_writing.wait()
            os.write(fd, data)
        return write

    commits = [durable.Commit(meeting_writer(b"a"), dest, "a"), durable.Commit(meeting_writer(b"b"), dest, "b"),
               durable.Commit(_writer(b"c"), dest, "c")]
    assert durable.durable_commit_all(tmp, commits, write_threads=2) == ["a", "b", "c"]
    assert [(root / "dest" / n).read_bytes() for n in "abc"] == [b"a", b"b", b"c"]
    assert os.listdir(root / "tmp") == []


def test_a_failed_write_among_concurrent_ones_starts_no_more_publishes_nothing_and_leaves_no_temporary(dirs):
    root, tmp, dest = dirs
    failed, started = threading.Event(), []

    def slow_ok(fd):  # still writing when its neighbour fails; its file is removed too
        assert failed.wait(timeout=30)
        time.sleep(0.2)
        os.write(fd, b"ok")

    def fail(fd):
        os.write(fd, b"partial")
        failed.set()
        raise OSError(errno.ENOSPC, "No space left on device")

    def later(i):
        def write(fd):
            started.append(i)
            time.sleep(0.05)
            os.write(fd, b"later")
        return write

    commits = [durable.Commit(slow_ok, dest, "a"), durable.Commit(fail, dest, "b")]
    commits += [durable.Commit(later(i), dest, f"c{i}") for i in range(30)]
    with pytest.raises(DurableWriteError) as info:
        durable.durable_commit_all(tmp, commits, write_threads=2)
    assert info.value.stage == "write" and info.value.errno == errno.ENOSPC
    assert len(started) < 30  # the writes queued behind the failure never began
    assert os.listdir(root / "dest") == [] and os.listdir(root / "tmp") == []
