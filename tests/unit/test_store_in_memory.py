"""A Store over the in-memory backend runs a whole save and restore of real training state, and no file
of the file system is opened, created, listed, renamed or removed while it does."""
import contextlib
import sys

import torch

import alpha_ckpt
from alpha_ckpt.store import Store
from alpha_ckpt.store.in_memory import InMemoryBackend
from gpt_training import Trainer, assert_identical

MASKS = ("*.causal_mask",)
_FILE_EVENTS = ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.listdir", "os.scandir", "os.link",
                "os.symlink", "os.truncate", "os.chmod", "os.chown", "os.utime", "os.chdir", "shutil.rmtree",
                "shutil.copyfile", "shutil.move", "tempfile.mkstemp", "tempfile.mkdtemp")
_touched: list | None = None  # the file events seen while a test watches; None: nobody watches


def _audit(event: str, args: tuple) -> None:
    if _touched is not None and event in _FILE_EVENTS:
        _touched.append((event, args[:1]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one records only while _touched is a list


@contextlib.contextmanager
def _file_events():
    global _touched
    _touched = seen = []
    try:
        yield seen
    finally:
        _touched = None


def _state(t: Trainer) -> dict:
    return {"model": t.model, "optim": t.optim, "warmup": t.warmup, "steps": t.steps, "side": t.side,
            "cycle": t.cycle, "loader": t.data, "rng": alpha_ckpt.RNGState(), "step": t.step}


def test_a_store_over_the_in_memory_backend_saves_and_restores_bit_for_bit_touching_no_file():
    uninterrupted = Trainer(seed=0)
    uninterrupted.train(5)
    # Every Trainer is built before the one saved trains: building one seeds the global generators.
    warm, fresh, trained = Trainer(seed=1), Trainer(seed=7), Trainer(seed=0)
    trained.train(3)
    # Once outside the watch, so that what Python imports lazily on a first call is not counted.
    warmup = Store(InMemoryBackend(), write_mode="buffered")
    warm_root = alpha_ckpt.save(_state(trained), store=warmup, run="r", step="s", update=3, cursor=12, epoch=0,
                                allow_nonfinite=MASKS)
    alpha_ckpt.restore(_state(warm), store=warmup, root=warm_root)  # sets the generators to the saved ones

    backend = InMemoryBackend()
    with _file_events() as touched:
        store = Store(backend, write_mode="buffered")
        root = alpha_ckpt.save(_state(trained), store=store, run="r", step="s", update=3, cursor=12, epoch=0,
                               allow_nonfinite=MASKS)
        alpha_ckpt.verify(store, root)
        assert alpha_ckpt.latest(store, "r", "s") == root
        counters = alpha_ckpt.restore(_state(fresh), store=store, root=root)
        store.close()
    assert touched == []
    assert backend.objects and backend.refs[("r", "s")] and not backend.leases  # the lease was given back
    assert (counters.update, counters.cursor, counters.epoch) == (3, 12, 0)
    assert_identical(fresh.model.state_dict(), trained.model.state_dict())
    assert_identical(fresh.optim.state_dict(), trained.optim.state_dict())
    assert_identical(fresh.loader.state_dict(), trained.loader.state_dict())
    fresh.train(2)
    assert fresh.losses == uninterrupted.losses[3:]  # training goes on as if never interrupted


def test_the_watch_sees_a_file_opened_on_the_file_system(tmp_path):
    with _file_events() as touched:
        (tmp_path / "seen").write_bytes(b"x")
    assert [event for event, _ in touched] == ["open"]
