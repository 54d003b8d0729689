import subprocess

import pytest
import torch

import alpha_ckpt
from alpha_ckpt.format.records import DTYPES, CapturePrefix
from alpha_ckpt.state.manifest import regions_of
from alpha_ckpt.state.capture import flatten_state
from alpha_ckpt.generation.planner import Piece
from alpha_ckpt.store import Store
from alpha_ckpt.testing.forge import publish_forged
from alpha_ckpt.generation.writer import word_bytes


def small_state(seed: int = 0) -> dict:
    """A small nested state with several dtypes, a 0-dim and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16)},
        "optim": {"step": torch.tensor(3, dtype=torch.int64), "m": torch.randn(6, 5, generator=g).double()},
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
    }


def zeros_like_state(state: dict) -> dict:
    return {k: zeros_like_state(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in state.items()}


def assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_bit_equal(a[k], b[k])
        else:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            x, y = a[k].contiguous().reshape(-1), b[k].contiguous().reshape(-1)
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k


def save_forged(state: dict, store_dir, *, update: int = 1, cursor: int = 0, epoch: int = 0,
                compression: str = "raw", run: str = "r", step: str = "s") -> str:
    """Publish a generation that publication refuses (NaN/inf words), as alpha_ckpt.testing.forge makes one:
    restore's own checks must refuse it (an old store, or damage with the checksums repaired)."""
    named = flatten_state(state)
    regions = regions_of(named)
    shards = [[(Piece(r.ordinal, 0, r.words, DTYPES[r.dtype][0]), memoryview(word_bytes(t).numpy()), compression)]
              for r, (_, t) in zip(regions, named)]
    with Store(store_dir) as s:
        return publish_forged(s, CapturePrefix(run, step, update, cursor, epoch), regions, shards).root


S3_BUCKET = "alpha-ckpt-tests"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3 server (SeaweedFS) per test process, with the tests' bucket."""
    from alpha_ckpt.testing.s3_server import S3Server
    server = S3Server(tmp_path_factory.mktemp("s3-server")).start()
    try:
        server.make_bucket(S3_BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_store(s3_server, monkeypatch) -> str:
    """A fresh store on the S3 server (a prefix of its own), with the AWS environment pointing at the server."""
    import secrets
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    return f"s3://{S3_BUCKET}/{secrets.token_hex(6)}"


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(size): a tmpfs of our own (root writes through permission bits, not through a read-only
    mount or a full one); unmounted after the test; the test is skipped where mounting is not permitted."""
    mounted = []

    def mount(size: str = "64m"):
        mnt = tmp_path / f"mnt{len(mounted)}"
        mnt.mkdir()
        try:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True,
                           capture_output=True, timeout=30)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.skip(f"cannot mount a tmpfs here: {exc}")
        mounted.append(mnt)
        return mnt
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory, worker_id):
    """once_per_run(key, make): ``make(folder)``'s JSON result, made once per test run and shared by every
    xdist worker (the others wait for it instead of making it again): a run that never stopped, say, which
    tests of one module compare with on whichever worker they land. ``folder`` is kept for the run."""
    import fcntl
    import json
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if worker_id != "master" else base  # the run's folder, above each worker's

    def once(key: str, make):
        folder = shared / f"once-{key}"
        with open(shared / f"once-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            made = folder / "result.json"
            if made.exists():
                return json.loads(made.read_text())
            folder.mkdir(exist_ok=True)
            result = make(folder)
            made.write_text(json.dumps(result))
            return result
    return once


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def saved(store_dir):
    """A small published generation: (store dir, root digest, state)."""
    state = small_state()
    root = alpha_ckpt.save(state, store=store_dir, run="nightly", step="fit", update=3, cursor=96, epoch=0,
                           max_shard_bytes=128)
    return store_dir, root, state


def pytest_sessionstart(session):
    """Every process a test starts runs this checkout's code, whatever copy of alpha_ckpt the interpreter has
    installed (or none): this checkout's folder leads PYTHONPATH for the whole session.

    Where tests run (an xdist worker, or a run without -n), the harness's fork server starts at once and
    imports torch while the tests are collected: no test's timeout pays for it."""
    import os
    from alpha_ckpt.testing.launch import child_env
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        from alpha_ckpt.testing.launch import start_fork_server
        start_fork_server()


def pytest_collection_modifyitems(config, items):
    """``full`` tests (slow variants of what CI already covers) run only with ALPHA_CKPT_FULL=1. ``slow`` ones
    (long-haul cases CI runs after the default command, with ``-m slow``) run when the marker expression names
    them, or with ALPHA_CKPT_FULL=1."""
    import os
    if os.environ.get("ALPHA_CKPT_FULL") == "1":
        return
    skip_full = pytest.mark.skip(reason="full set: run with ALPHA_CKPT_FULL=1")
    wanted_slow = "slow" in (config.getoption("markexpr") or "")
    skip_slow = pytest.mark.skip(reason="slow: CI runs it with python -m pytest -n 2 -m slow")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip_full)
        elif "slow" in item.keywords and not wanted_slow:
            item.add_marker(skip_slow)
