"""A star publication that loses its ref race fails cleanly on every owner (PublishFailed: exit 75)."""
import os
import subprocess
import sys
import textwrap

import pytest

OWNER = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from alpha_ckpt.errors import PublishConflict, PublishFailed
    from alpha_ckpt.format import CapturePrefix
    from alpha_ckpt.manifest import flatten_state, regions_of
    from alpha_ckpt.publish.star import build_capture, publish_star
    from alpha_ckpt.store import Store

    rank, store_dir, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    named = flatten_state({"w": torch.ones(8)})
    regions = regions_of(named)
    capture = build_capture(CapturePrefix("r", "s", 1, 1, 0), regions, [t for _, t in named], [None])
    store = Store(store_dir) if rank == 0 else None
    if rank == 0:
        def lost_race(self, prefix, *args, **kwargs):
            raise PublishConflict("generation 1 of r/s was published by another publisher")
        Store.publish_ref = lost_race
    try:
        publish_star(store, capture, regions, {})
        outcome = "published"
    except PublishFailed:
        outcome = "publish-failed"
    print(outcome, flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_a_lost_ref_race_in_the_star_is_a_clean_failure_on_every_owner(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    owners = [subprocess.Popen([sys.executable, "-c", OWNER, str(rank), str(tmp_path / "store"), init],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"}) for rank in (0, 1)]
    results = []
    for proc in owners:
        out, err = proc.communicate(timeout=100)
        results.append((proc.returncode, out.strip(), err[-1500:]))
    assert [(code, out) for code, out, _ in results] == [(0, "publish-failed")] * 2, results
