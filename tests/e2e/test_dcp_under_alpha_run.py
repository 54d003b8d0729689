"""A refusal inside torch.distributed.checkpoint (dcp.save / dcp.load with alpha_ckpt's StorageWriter and
StorageReader) exits 3 under alpha-run, as any refusal of a script does; the backend itself:
tests/distributed/test_dcp_backend.py."""
import textwrap

import pytest

from alpha_ckpt.store import Store
from alpha_ckpt.testing import launch


_REFUSED_UNDER_ALPHA_RUN = textwrap.dedent('''
    import sys
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from alpha_ckpt.dcp import StorageReader, StorageWriter

    store, what = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if what == "save":  # a NaN no allow_nonfinite pattern declares
        dcp.save({"w": torch.full((4,), float("nan"))}, storage_writer=StorageWriter(store, run="r", update=1))
    else:  # "latest" of a run with no generation
        dcp.load({"w": torch.zeros(4)}, storage_reader=StorageReader(store, run="r"))
''')


@pytest.mark.timeout(180)
@pytest.mark.parametrize("what", ["save", "load"])
def test_a_refusal_inside_dcp_under_alpha_run_exits_3(tmp_path, what):
    script = tmp_path / "dcp_refused.py"
    script.write_text(_REFUSED_UNDER_ALPHA_RUN)
    store = tmp_path / "store"
    Store(store).close()
    # One rank: DCP wraps a refusal in its CheckpointException whatever the rank count.
    done = launch.alpha_run("--nproc", "1", "--store", store, script, store, what, timeout=150)
    assert done.returncode == 3, done.stderr[-3000:]
