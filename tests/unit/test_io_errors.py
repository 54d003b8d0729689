"""I/O errors, SQLite style: a countdown makes the N-th write, fsync, link or rename fail with an errno.

For every N until a publish completes without reaching the countdown, and for
EIO, ENOSPC, EDQUOT and EINVAL: a failed publish leaves nothing in STORE/tmp,
publishes no ref, and leaves the previous generation whole; an fsync is never
retried on a descriptor; EINVAL from renameat2 (and only from it) takes the
link()+unlink() fallback; EEXIST is a conflict, never an overwrite.
"""
import errno
import os

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.store import durable
from alpha_ckpt.errors import DurableWriteError, PublishConflict
from alpha_ckpt.format.records import CapturePrefix
from alpha_ckpt.generation.reader import verify_generation
from alpha_ckpt.store import Store

ERRNOS = [errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EINVAL]
OPS = ["write", "fsync", "link", "rename"]


class Countdown:
    """Fail the ``n``-th call of ``op`` with ``err``; record any fsync of a file whose fsync failed."""

    def __init__(self, monkeypatch, op: str, n: int, err: int):
        self.op, self.left, self.err, self.fired = op, n, err, False
        self.failed_file = None
        self.retried: list[tuple[int, int]] = []
        real = {"pwrite": os.pwrite, "write": os.write, "fsync": os.fsync, "link": os.link,
                "rename": durable._renamer.renameat2_noreplace}

        def counted(name, kind):
            def call(*args, **kwargs):
                if kind == "fsync":
                    st = os.fstat(args[0])
                    if (st.st_dev, st.st_ino) == self.failed_file:
                        self.retried.append(self.failed_file)
                if kind == self.op and not self.fired:
                    self.left -= 1
                    if self.left == 0:
                        self.fired = True
                        if kind == "fsync":
                            st = os.fstat(args[0])
                            self.failed_file = (st.st_dev, st.st_ino)
                        raise OSError(self.err, os.strerror(self.err))
                return real[name](*args, **kwargs)
            return call

        monkeypatch.setattr(os, "pwrite", counted("pwrite", "write"))
        monkeypatch.setattr(os, "write", counted("write", "write"))
        monkeypatch.setattr(os, "fsync", counted("fsync", "fsync"))
        monkeypatch.setattr(os, "link", counted("link", "link"))
        monkeypatch.setattr(durable._renamer, "renameat2_noreplace", counted("rename", "rename"))


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "step": torch.tensor(seed)}


def _publish(store, update):
    return alpha_ckpt.save(_state(update), store=store, run="r", step="s", update=update, cursor=update, epoch=0)


@pytest.mark.parametrize("err", ERRNOS, ids=errno.errorcode.get)
@pytest.mark.parametrize("op", OPS)
def test_the_nth_failing_call_fails_the_generation_cleanly(tmp_path, monkeypatch, op, err):
    store = Store(tmp_path / "store")
    previous = _publish(store, 1)
    for n in range(1, 40):
        with monkeypatch.context() as patch:
            countdown = Countdown(patch, op, n, err)
            try:
                root = _publish(store, 2 + n)
                failed = None
            except (DurableWriteError, OSError) as exc:
                failed = exc
        assert os.listdir(tmp_path / "store" / "tmp") == []  # no temp file outlives a failure
        assert countdown.retried == []  # a file whose fsync failed is never fsynced again
        verify_generation(store, previous)
        refs = [r.root for r in store.list_refs("r", "s")]
        if failed is None:
            assert countdown.fired is False or (op == "rename" and err == errno.EINVAL), \
                "a failure that was injected must fail the publish (except EINVAL from renameat2)"
            assert refs[-1] == root
            verify_generation(store, root)
            if not countdown.fired:
                return  # the countdown outlived the publish: every call site was covered
        else:
            assert countdown.fired
            assert len(refs) == len(set(refs))  # nothing published twice, nothing overwritten
    pytest.fail("the countdown never outlived a publish")


def test_an_fsync_error_is_not_retried(tmp_path, monkeypatch):
    store = Store(tmp_path / "store")
    countdown = Countdown(monkeypatch, "fsync", 1, errno.EIO)
    with pytest.raises(DurableWriteError) as info:
        _publish(store, 1)
    assert info.value.stage == "data-fsync"
    assert countdown.failed_file is not None and countdown.retried == []  # fsynced once, then abandoned
    assert os.listdir(tmp_path / "store" / "tmp") == []


def test_einval_from_renameat2_takes_the_link_fallback_and_nothing_else_does(tmp_path, monkeypatch):
    store = Store(tmp_path / "store")
    links = []
    real_link = os.link
    monkeypatch.setattr(os, "link", lambda *a, **k: (links.append(a), real_link(*a, **k))[1])

    def no_noreplace(*args):
        raise OSError(errno.EINVAL, "no RENAME_NOREPLACE here")
    monkeypatch.setattr(durable._renamer, "renameat2_noreplace", no_noreplace)
    root = _publish(store, 1)
    verify_generation(store, root)
    assert links  # every object and the ref went through link()+unlink()
    for err in (errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EPERM):
        def failing(*args, err=err):
            raise OSError(err, os.strerror(err))
        monkeypatch.setattr(durable._renamer, "renameat2_noreplace", failing)
        links.clear()
        with pytest.raises(DurableWriteError):
            _publish(store, 2)
        assert links == []


def test_eexist_is_a_conflict_never_an_overwrite(tmp_path):
    store = Store(tmp_path / "store")
    first = _publish(store, 1)
    record = store.list_refs("r", "s")[0]
    ref_path = tmp_path / "store" / "refs" / "r" / "s" / "0000000001"
    before = ref_path.read_bytes()

    def racing_publisher(*args):
        raise FileExistsError(errno.EEXIST, "taken")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(durable._renamer, "renameat2_noreplace", racing_publisher)
        with pytest.raises(PublishConflict):
            store.publish_ref(CapturePrefix("r", "s", 2, 2, 0), record.root, record.root_size, record.bytes, owners=1)
    assert ref_path.read_bytes() == before and os.listdir(tmp_path / "store" / "tmp") == []
    verify_generation(store, first)


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC, errno.EDQUOT], ids=errno.errorcode.get)
def test_a_failing_link_in_the_fallback_fails_the_generation_cleanly(tmp_path, monkeypatch, err):
    store = Store(tmp_path / "store")
    previous = _publish(store, 1)

    def no_noreplace(*args):
        raise OSError(errno.EINVAL, "no RENAME_NOREPLACE here")
    for n in range(1, 20):
        with monkeypatch.context() as patch:
            countdown = Countdown(patch, "link", n, err)
            patch.setattr(durable._renamer, "renameat2_noreplace", no_noreplace)
            try:
                _publish(store, 1 + n)
                failed = False
            except DurableWriteError:
                failed = True
        assert failed == countdown.fired
        assert os.listdir(tmp_path / "store" / "tmp") == []
        verify_generation(store, previous)
        if not countdown.fired:
            return
    pytest.fail("the countdown never outlived a publish")
