"""A store on S3 behind a proxy that injects faults (a real server, SeaweedFS, behind it): 503 SlowDown is
retried, a reply lost after the server acted is told from another writer's object or ref by its bytes, a
part corrupted in transit is refused by its checksum and sent again (or the save fails with nothing
published), and a server that ignores a conditional write is refused before anything is published."""
import pytest
import torch

import alpha_ckpt
from alpha_ckpt.errors import DurableWriteError, StoreUsageError
from alpha_ckpt.store import Store
from alpha_ckpt.testing.s3_proxy import Fault, S3Proxy


@pytest.fixture
def proxied(s3_server, s3_store, monkeypatch):
    with S3Proxy(s3_server.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        yield s3_store, proxy


def _state(seed: int, words: int = 1 << 10) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(words, generator=g), "b": torch.randn(7, generator=g).double()}


def _save(url: str, state: dict, update: int) -> str:
    return alpha_ckpt.save(state, store=url, run="r", step="s", update=update, cursor=update, epoch=0)


def _restored(url: str, root: str, like: dict) -> dict:
    back = {k: torch.zeros_like(v) for k, v in like.items()}
    alpha_ckpt.restore(back, store=url, root=root)
    return back


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_slowdown_answers_are_retried_and_the_save_restores(proxied):
    url, proxy = proxied
    fault = proxy.inject(Fault("slowdown", method="PUT"))
    state = _state(0)
    root = _save(url, state, 1)
    assert fault.hits == 1
    _assert_equal(_restored(url, root, state), state)


@pytest.mark.parametrize("where", ["/refs/", "/objects/"])
def test_a_reply_lost_after_a_conditional_put_is_told_apart_by_its_bytes(proxied, where):
    url, proxy = proxied
    state = _state(1)
    fault = proxy.inject(Fault("drop_reply", method="PUT", key_contains=where))
    root = _save(url, state, 1)
    assert fault.hits == 1
    with Store(url, create=False) as store:
        assert [r.root for r in store.list_refs("r", "s")] == [root]  # one generation, not a conflict
    _assert_equal(_restored(url, root, state), state)


def test_a_part_corrupted_in_transit_is_refused_by_its_checksum_and_sent_again(proxied):
    url, proxy = proxied
    state = _state(2, 6 << 20)  # 24 MiB: a multipart upload
    fault = proxy.inject(Fault("corrupt_body", method="PUT", key_contains="partNumber=2"))
    root = _save(url, state, 1)
    assert fault.hits == 1
    _assert_equal(_restored(url, root, state), state)


def test_a_part_corrupted_every_time_fails_the_save_and_publishes_nothing(proxied):
    url, proxy = proxied
    first = _state(3)
    kept = _save(url, first, 1)
    proxy.inject(Fault("corrupt_body", method="PUT", key_contains="/objects/", times=1000))
    with pytest.raises(DurableWriteError) as failed:
        _save(url, _state(4, 6 << 20), 2)
    assert "/objects/" in str(failed.value)
    assert alpha_ckpt.latest(url, "r", "s") == kept  # the previous generation is still the head
    client = proxy_client(proxy)
    bucket, prefix = url[len("s3://"):].split("/", 1)
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []  # aborted


def proxy_client(proxy):
    from alpha_ckpt.testing.s3_server import S3Server
    import boto3
    return boto3.client("s3", endpoint_url=proxy.endpoint, aws_access_key_id=S3Server.ACCESS_KEY,
                        aws_secret_access_key=S3Server.SECRET_KEY, region_name=S3Server.REGION)


@pytest.mark.parametrize("method, key, feature", [
    ("PUT", "/probe/", "If-None-Match on PutObject"),
    ("POST", "uploadId=", "If-None-Match on CompleteMultipartUpload"),
    ("DELETE", "/probe/", "If-Match on DeleteObject"),
])
def test_a_server_that_ignores_a_conditional_write_is_refused_before_anything_is_written(proxied, method, key,
                                                                                         feature):
    url, proxy = proxied
    proxy.inject(Fault("strip_conditions", method=method, key_contains=key, times=1000))
    with pytest.raises(StoreUsageError) as refused:
        Store(url)
    message = str(refused.value)
    assert feature in message and proxy.endpoint in message and "\n" not in message
    with pytest.raises(StoreUsageError):
        _save(url, _state(5), 1)
    client = proxy_client(proxy)
    bucket, prefix = url[len("s3://"):].split("/", 1)
    assert client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("KeyCount", 0) == 0  # nothing published


def test_a_stalled_upload_fails_the_save_at_its_deadline_naming_the_object_and_aborts_the_upload(proxied,
                                                                                                monkeypatch, tmp_path):
    import time
    url, proxy = proxied
    kept = _save(url, _state(6), 1)
    config = tmp_path / "aws-config"  # objects above 64 KiB go in parts: the 1 MiB state is a multipart upload
    config.write_text("[default]\ns3 =\n  multipart_threshold = 64KB\n  multipart_chunksize = 5MB\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    proxy.inject(Fault("stall", method="PUT", key_contains="uploadId=", seconds=30))
    with Store(url) as store:
        started = time.monotonic()
        with store.deadline(2.0), pytest.raises(DurableWriteError) as failed:
            alpha_ckpt.save(_state(7, 1 << 18), store=store, run="r", step="s", update=2, cursor=2, epoch=0)
        took = time.monotonic() - started
    assert failed.value.stage == "deadline" and "/objects/" in str(failed.value)
    assert took < 10  # the stall lasts 30 s: the save did not wait for it
    assert alpha_ckpt.latest(url, "r", "s") == kept  # nothing of the failed save is resumable
    client = proxy_client(proxy)
    bucket, prefix = url[len("s3://"):].split("/", 1)
    assert client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []  # aborted

