"""An S3-compatible object store as a storage backend (:class:`~alpha_ckpt.store.backend.StorageBackend`).

A store named ``s3://BUCKET/PREFIX`` keeps its keys under ``PREFIX/`` (the layout of
:mod:`alpha_ckpt.store.layout`, as keys)::

    PREFIX/objects/ab/abcdef...         shards and manifests, put only if absent
    PREFIX/refs/RUN/STEP/0000000007     one per generation, put only if absent: of two publishers, one wins
    PREFIX/refs/RUN/STEP/head           the highest generation number known published (a hint, only raised)
    PREFIX/pending/<name>               leases of publishes in flight; their time is the server's
    PREFIX/renewed/<digest>             when a publish last reused the object (the server's time)
    PREFIX/doomed/<digest>              gc is deciding whether to delete the object (alpha_ckpt.store.s3_sweep)
    PREFIX/pins/<root>                  pinned generations, put only if absent
    PREFIX/quarantine/<name>            what was set aside (a damaged object, an unreadable ref)
    PREFIX/outputs/RUN/STEP/<name>      a job's declared outputs
    PREFIX/instance                     the store's instance id, put only if absent

What the POSIX backend gets from ``rename(RENAME_NOREPLACE)`` this one gets from S3's conditional writes:
``If-None-Match: *`` on PutObject and on CompleteMultipartUpload (a name already taken answers 412, and
nothing is overwritten), ``If-Match`` on the ETag for the head hint and for every delete. A server that
ignores any of them is refused when the store is opened for writing, before anything is published
(:func:`check_conditional_writes`). Endpoint, region and credentials come from the standard AWS
configuration (environment, ``AWS_ENDPOINT_URL``, profiles); they never appear in a message.

No LIST is made by a save or a restore: a run's newest generation is found from its head hint and a
probe of the numbers above it. Only gc and ``alpha-ckpt`` list.
"""
from __future__ import annotations

import email.utils
import errno
import logging
import math
import mmap
import os
import re
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterator, Sequence

from alpha_ckpt.errors import DurableWriteError, Refusal, RefusalCode, StoreUsageError
from alpha_ckpt.format.records import is_digest
from alpha_ckpt.store import layout as L
from alpha_ckpt.store.backend import (ObjectContent, PutResult, RefDir, RefUnreadable, check_opened_size,
                                      content_of)
from alpha_ckpt.store.layout import fan_of, ref_name
from alpha_ckpt.store.objects import FAN_NAME_RE, ObjectFile, Validate
from alpha_ckpt.store.refs import MAX_REF_BYTES, REF_NAME_RE
from alpha_ckpt.runtime.hooks import fault_point

logger = logging.getLogger("alpha_ckpt")

MIB = 1 << 20
MIN_PART_BYTES = 5 * MIB       # S3's smallest part (but the last)
MAX_PART_BYTES = 5 << 30       # S3's largest part
MAX_PARTS = 10_000             # S3's most parts of one upload
DEFAULT_PART_BYTES = 16 * MIB  # an object up to this size is one PutObject, a larger one is uploaded in parts of
                               # this size (a profile's s3.multipart_threshold and multipart_chunksize change them)
S3_FAULT_POINTS = ("before-put", "after-put", "after-first-part", "before-complete")  # see runtime.faults
PART_THREADS = 8               # parts of one object uploaded (or ranges downloaded) at once
READ_PART_BYTES = 16 * MIB     # the range one GET of a restore reads
CONFLICT_RETRIES = 5           # a 409 or a body refused by its checksum is sent again this many times
RENEWED = "renewed"
DOOMED = "doomed"
DOOM_BOUND_S = 60.0            # gc deletes within this of marking an object doomed; a save waits at most this
PROBE = "probe"
HEAD_HINT = "head"
INSTANCE_RE = re.compile(r"\A[0-9a-f]{32}\Z")
_BUCKET_RE = re.compile(r"\A[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")
_SEGMENT_RE = re.compile(r"\A[A-Za-z0-9._=-]+\Z")


def _size(text: str) -> int:
    """A size as the AWS CLI's configuration writes it: "8MB", "64KB", "1GB" (powers of 1024), or bytes."""
    text = str(text).strip().upper().replace("IB", "B")
    for suffix, scale in (("KB", 1 << 10), ("MB", 1 << 20), ("GB", 1 << 30), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * scale)
    return int(text)


def transfer_sizes(client) -> tuple[int, int]:
    """(the size above which an object is uploaded in parts, the part size) from the profile's ``s3`` section,
    ``multipart_threshold`` and ``multipart_chunksize``, as the AWS CLI reads them (default 16 MiB each)."""
    try:
        section = client._alpha_ckpt_s3_config  # set by make_client from the session's profile
    except AttributeError:
        section = {}
    threshold = _size(section.get("multipart_threshold", DEFAULT_PART_BYTES))
    chunk = _size(section.get("multipart_chunksize", DEFAULT_PART_BYTES))
    return max(0, threshold), min(MAX_PART_BYTES, max(MIN_PART_BYTES, chunk))


def part_bytes(size: int, base: int = DEFAULT_PART_BYTES) -> int:
    """The part size of a multipart upload of ``size`` bytes: ``base``, grown (in whole MiB) so the upload
    needs at most :data:`MAX_PARTS` parts, within S3's 5 MiB to 5 GiB a part."""
    grown = max(base, math.ceil(size / MAX_PARTS / MIB) * MIB)
    return min(MAX_PART_BYTES, max(MIN_PART_BYTES, grown))


def part_ranges(size: int, part: int) -> list[tuple[int, int]]:
    """The [lo, hi) byte ranges of consecutive parts of ``part`` bytes covering ``size`` bytes."""
    return [(lo, min(size, lo + part)) for lo in range(0, size, part)]


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://BUCKET[/PREFIX]``; StoreUsageError naming the URL if it is not one."""
    rest = url[len("s3://"):] if url.lower().startswith("s3://") else None
    if rest is None:
        raise StoreUsageError(f"store {url}: not an s3:// URL")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise StoreUsageError(f"store {url}: {bucket!r} is not a bucket name (3-63 lower-case letters, digits, "
                              "dots and hyphens)")
    segments = [s for s in prefix.split("/") if s]
    bad = [s for s in segments if not _SEGMENT_RE.match(s) or s in (".", "..")]
    if bad:
        raise StoreUsageError(f"store {url}: prefix segment {bad[0]!r} is not a plain name (letters, digits, . _ = -)")
    return bucket, "/".join(segments)


def _error(exc: Exception) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a client error; ('', 0) for anything else (a connection error)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", 0
    return str(response.get("Error", {}).get("Code", "")), int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _taken(exc: Exception) -> bool:
    """A conditional write refused because the name is taken (or the ETag moved): 412."""
    code, status = _error(exc)
    return status == 412 or code == "PreconditionFailed"


def _conflict(exc: Exception) -> bool:
    """A conditional write that raced another on the same key (409): S3 says to retry it."""
    code, status = _error(exc)
    return status == 409 or code == "ConditionalRequestConflict"


def _retryable(exc: Exception) -> bool:
    """What is worth sending again that the client's own retries do not send again: a conflicting conditional
    write in flight (409), and a body that reached the server other than it was sent (its checksum refused
    it in transit)."""
    code, _ = _error(exc)
    return _conflict(exc) or code in ("BadDigest", "XAmzContentSHA256Mismatch")


def _absent(exc: Exception) -> bool:
    code, status = _error(exc)
    return status == 404 or code in ("NoSuchKey", "NotFound", "404")


def _object_size(got: dict) -> int:
    """The whole object's size from a GET's answer (a ranged one gives it after the slash of Content-Range)."""
    return int(got["ContentRange"].rsplit("/", 1)[1]) if got.get("ContentRange") else got["ContentLength"]


def _client_errors() -> tuple[type[Exception], ...]:
    import botocore.exceptions
    return (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError)


def make_client(url: str, attempts: int = 10, connect_timeout_s: float = 60.0):
    """An S3 client from the standard AWS configuration, with adaptive retries (503 SlowDown, 5xx, throttling)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise StoreUsageError(f"store {url}: an s3:// store needs boto3 (pip install 'alpha_ckpt[s3]')") from None
    config = Config(retries={"mode": "adaptive", "max_attempts": attempts}, max_pool_connections=4 * PART_THREADS,
                    connect_timeout=connect_timeout_s,
                    request_checksum_calculation="when_required", response_checksum_validation="when_required")
    session = boto3.session.Session()
    client = session.client("s3", config=config)
    scoped = session._session.get_scoped_config().get("s3", {})
    client._alpha_ckpt_s3_config = scoped if isinstance(scoped, dict) else {}
    return client


# What check_conditional_writes found per (endpoint, bucket), for this process: None when all is honoured.
_conditional_writes: dict[tuple[str, str], str | None] = {}
_conditional_lock = threading.Lock()


class S3Backend:
    """The keys under one bucket and prefix (see the module's docstring)."""

    def __init__(self, url: str, create: bool = True, client: Any = None):
        self.bucket, self.prefix = parse_url(url)
        self.location = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self._client_given = client is not None
        self.client = client if client is not None else make_client(url)
        self.endpoint = str(self.client.meta.endpoint_url)
        self._errors = _client_errors()
        self._parts = ThreadPoolExecutor(PART_THREADS, thread_name_prefix="alpha-ckpt-s3")
        self.multipart_threshold, self.part_size = transfer_sizes(self.client)
        self.deadline: float | None = None  # monotonic time the writes in progress must end by (Store.deadline)
        self._in_flight: dict[str, str] = {}  # key of each object being put -> its multipart upload ("" if none)
        self._in_flight_lock = threading.Lock()
        self._check_bucket()
        if create:
            self.check_conditional_writes()

    # ------------------------------------------------------------ keys and requests

    def key(self, *names: str) -> str:
        return "/".join(n for n in (self.prefix, *names) if n)

    def _object_key(self, digest: str) -> str:
        return self.key(L.OBJECTS, fan_of(digest), digest)

    def _fail(self, stage: str, key: str, exc: Exception) -> DurableWriteError:
        code, status = _error(exc)
        why = f"{code} ({status})" if code else type(exc).__name__
        return DurableWriteError(stage, errno.EIO, f"s3://{self.bucket}/{key} at {self.endpoint}: {why}")

    def _check_bucket(self) -> None:
        """A usage error, said at once, where the store cannot be used at all (no bucket, no access, no server,
        no credentials): the check's client gives up after two tries, not after the adaptive retries."""
        import botocore.exceptions
        try:
            quick = self.client if self._client_given else make_client(self.location, 2, 5.0)
            quick.head_bucket(Bucket=self.bucket)
        except botocore.exceptions.NoCredentialsError:
            raise StoreUsageError(f"store {self.location}: no AWS credentials (environment, profile or instance "
                                  "role)") from None
        except self._errors as exc:
            code, status = _error(exc)
            if status == 404 or code in ("NoSuchBucket", "404"):
                raise StoreUsageError(f"store {self.location}: bucket {self.bucket!r} does not exist at "
                                      f"{self.endpoint}") from None
            if status in (401, 403):
                raise StoreUsageError(f"store {self.location}: access to bucket {self.bucket!r} at {self.endpoint} "
                                      f"is denied ({code or status})") from None
            raise StoreUsageError(f"store {self.location}: the server at {self.endpoint} cannot be reached "
                                  f"({code or type(exc).__name__})") from None

    def _get(self, key: str, **kw) -> dict | None:
        """GetObject, or None where the key is absent."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key, **kw)
        except self._errors as exc:
            if _absent(exc):
                return None
            raise

    def _head(self, key: str) -> dict | None:
        try:
            return self.client.head_object(Bucket=self.bucket, Key=key)
        except self._errors as exc:
            if _absent(exc):
                return None
            raise

    def _put_if_absent(self, key: str, body, length: int | None = None, kind: str = "") -> bool:
        """PutObject with ``If-None-Match: *``: True if put, False if the name was taken (nothing overwritten).
        ``kind`` (object, ref): the fault points around the put, for the crash gates."""
        extra = {} if length is None else {"ContentLength": length}
        for attempt in range(CONFLICT_RETRIES + 1):
            try:
                if hasattr(body, "seek"):
                    body.seek(0)
                if kind:
                    fault_point(kind, "before-put")
                self.client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*",
                                       ChecksumAlgorithm="SHA256", **extra)
                if kind:
                    fault_point(kind, "after-put")
                return True
            except self._errors as exc:
                if _taken(exc):
                    return False
                if not _retryable(exc) or attempt == CONFLICT_RETRIES:
                    raise self._fail("put", key, exc) from exc
                time.sleep(0.05 * 2 ** attempt)
        raise AssertionError("unreachable")

    def _delete_if_unchanged(self, key: str) -> bool:
        """Delete ``key`` only while it holds what was examined (``If-Match`` on its ETag): False if it was gone."""
        head = self._head(key)
        if head is None:
            return False
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key, IfMatch=head["ETag"])
            return True
        except self._errors as exc:
            if _absent(exc):
                return False
            if _taken(exc):  # replaced since it was examined: what is there now was not what was meant
                return False
            raise self._fail("delete", key, exc) from exc

    # ------------------------------------------------------------ conditional writes

    def check_conditional_writes(self) -> None:
        """Refuse (StoreUsageError, one line naming the endpoint and the missing feature) a server that ignores
        a conditional write this store relies on: PutObject and CompleteMultipartUpload with ``If-None-Match:
        *``, PutObject and DeleteObject with ``If-Match``. Probed once per endpoint and bucket per process."""
        where = (self.endpoint, self.bucket)
        with _conditional_lock:
            if where not in _conditional_writes:
                _conditional_writes[where] = self._probe_conditional_writes()
            missing = _conditional_writes[where]
        if missing:
            raise StoreUsageError(f"store {self.location}: the server at {self.endpoint} ignores {missing}, which "
                                  "keeps two writers of one name from overwriting each other; use a server that "
                                  "honours S3 conditional writes")

    def _probe_conditional_writes(self) -> str | None:
        key = self.key(PROBE, f"{os.getpid()}-{secrets.token_hex(8)}")
        c, b = self.client, self.bucket
        try:
            try:
                c.put_object(Bucket=b, Key=key, Body=b"1", IfNoneMatch="*")
            except self._errors as exc:
                raise self._fail("probe", key, exc) from exc
            try:
                c.put_object(Bucket=b, Key=key, Body=b"2", IfNoneMatch="*")
                return "If-None-Match on PutObject"
            except self._errors as exc:
                if not _taken(exc):
                    raise self._fail("probe", key, exc) from exc
            upload = c.create_multipart_upload(Bucket=b, Key=key)["UploadId"]
            try:
                etag = c.upload_part(Bucket=b, Key=key, UploadId=upload, PartNumber=1, Body=b"3")["ETag"]
                c.complete_multipart_upload(Bucket=b, Key=key, UploadId=upload, IfNoneMatch="*",
                                            MultipartUpload={"Parts": [{"ETag": etag, "PartNumber": 1}]})
                return "If-None-Match on CompleteMultipartUpload"
            except self._errors as exc:
                self._abort(key, upload)
                if not _taken(exc):
                    raise self._fail("probe", key, exc) from exc
            stale = '"00000000000000000000000000000000"'
            try:
                c.put_object(Bucket=b, Key=key, Body=b"4", IfMatch=stale)
                return "If-Match on PutObject"
            except self._errors as exc:
                if not _taken(exc):
                    raise self._fail("probe", key, exc) from exc
            try:
                c.delete_object(Bucket=b, Key=key, IfMatch=stale)
                if self._head(key) is None:
                    return "If-Match on DeleteObject"
            except self._errors as exc:
                if not _taken(exc):
                    raise self._fail("probe", key, exc) from exc
            return None
        finally:
            try:
                c.delete_object(Bucket=b, Key=key)
            except self._errors:
                pass

    # ------------------------------------------------------------ instance, leases, outputs

    def read_instance(self) -> str | None:
        got = self._get(self.key(L.INSTANCE))
        if got is None:
            return None
        text = got["Body"].read(64).decode("ascii", "replace").strip()
        return text if INSTANCE_RE.match(text) else None

    def make_instance(self) -> str:
        self._put_if_absent(self.key(L.INSTANCE), secrets.token_hex(16).encode() + b"\n")  # taken: the first id stands
        instance = self.read_instance()
        if instance is None:
            raise StoreUsageError(f"store {self.location}: its instance record is not one")
        return instance

    def put_lease(self, name: str, body: bytes) -> None:
        key = self.key(L.PENDING, name)
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body)
        except self._errors as exc:
            raise self._fail("lease", key, exc) from exc

    def remove_lease(self, name: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(L.PENDING, name))
        except self._errors as exc:  # best effort: a stale lease only delays gc
            logger.debug("store %s: lease %s not removed (%s)", self.location, name, _error(exc)[0])

    def put_output(self, run: str, step: str, name: str, data: bytes) -> str:
        key = self.key(L.OUTPUTS, run, step, name)
        self._put_if_absent(key, data)
        return f"s3://{self.bucket}/{key}"

    def probe_write(self) -> None:
        self.check_conditional_writes()

    # ------------------------------------------------------------ objects

    def put_objects(self, writes: Sequence[Callable[[int], str]], threads: int) -> list[PutResult]:
        """Each object put if absent, ``threads`` at once. With a :attr:`deadline`, what is still in flight
        then is abandoned: its multipart upload aborted (an object put whole is never referenced by a ref,
        gc's to remove), and a DurableWriteError at stage ``deadline`` names it."""
        pool = ThreadPoolExecutor(max(1, min(threads, len(writes))), thread_name_prefix="alpha-ckpt-s3-put")
        try:
            futures = [pool.submit(self._put_object, w) for w in writes]
            left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            _, pending = wait(futures, timeout=left)
            if pending:
                with self._in_flight_lock:
                    in_flight = dict(self._in_flight)
                for key, upload in in_flight.items():
                    if upload:
                        self._abort(key, upload)
                where = next(iter(in_flight), "an object not yet begun")
                raise DurableWriteError("deadline", errno.ETIMEDOUT, f"the save's time ran out with s3://{self.bucket}/"
                                        f"{where} still being written at {self.endpoint}; its upload was aborted")
            return [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _put_object(self, write: Callable[[int], str]) -> PutResult:
        content, release = content_of(write)
        try:
            if not is_digest(content.name):
                raise Refusal(RefusalCode.FORMAT, f"object name {content.name!r} is not a plain 64-hex digest")
            key = self._object_key(content.name)
            with self._in_flight_lock:
                self._in_flight[key] = ""
            try:
                if content.size <= self.multipart_threshold:
                    created = self._put_if_absent(key, content.reader(), content.size, "object")
                else:
                    created = self._put_multipart(key, content)
                return PutResult(content.name, content.size, created)
            finally:
                with self._in_flight_lock:
                    self._in_flight.pop(key, None)
        finally:
            release()

    def _put_multipart(self, key: str, content: ObjectContent) -> bool:
        """A multipart upload of ``content``, parts read from where they lie, completed only if the name is
        absent; any failure aborts the upload (no part stays billed or visible)."""
        c, b = self.client, self.bucket
        try:
            upload = c.create_multipart_upload(Bucket=b, Key=key, ChecksumAlgorithm="SHA256")["UploadId"]
        except self._errors as exc:
            raise self._fail("create-upload", key, exc) from exc
        with self._in_flight_lock:
            self._in_flight[key] = upload  # what a deadline aborts
        try:
            ranges = part_ranges(content.size, part_bytes(content.size, self.part_size))

            def send(number: int) -> dict:
                lo, hi = ranges[number - 1]
                for attempt in range(CONFLICT_RETRIES + 1):
                    try:
                        got = c.upload_part(Bucket=b, Key=key, UploadId=upload, PartNumber=number, ContentLength=hi - lo,
                                            Body=content.reader(lo, hi), ChecksumAlgorithm="SHA256")
                        if number == 1:
                            fault_point("object", "after-first-part")
                        return {"ETag": got["ETag"], "PartNumber": number, "ChecksumSHA256": got["ChecksumSHA256"]}
                    except self._errors as exc:
                        if not _retryable(exc) or attempt == CONFLICT_RETRIES:
                            raise self._fail(f"part {number} of {len(ranges)}", key, exc) from exc
                        time.sleep(0.05 * 2 ** attempt)
                raise AssertionError("unreachable")

            parts = list(self._parts.map(send, range(1, len(ranges) + 1)))
            fault_point("object", "before-complete")
            for attempt in range(CONFLICT_RETRIES + 1):
                try:
                    c.complete_multipart_upload(Bucket=b, Key=key, UploadId=upload, IfNoneMatch="*",
                                                MultipartUpload={"Parts": parts})
                    return True
                except self._errors as exc:
                    if _taken(exc):
                        self._abort(key, upload)
                        return False
                    if not _conflict(exc) or attempt == CONFLICT_RETRIES:
                        raise self._fail("complete", key, exc) from exc
                    time.sleep(0.05 * 2 ** attempt)
            raise AssertionError("unreachable")
        except BaseException:
            self._abort(key, upload)
            raise

    def _abort(self, key: str, upload: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        except self._errors as exc:  # gc aborts what is left after its grace period
            logger.debug("store %s: upload of %s not aborted (%s)", self.location, key, _error(exc)[0])

    def reuse_object(self, name: str, size: int | None, validate: Validate) -> bool:
        key = self._object_key(name)
        head = self._head(key)
        if head is None:
            return False
        problem = None
        if size is not None and head["ContentLength"] != size:
            problem = f"{head['ContentLength']} bytes, {size} expected"
        else:
            try:
                with self.open_object(name, "existing object") as obj:
                    validate(obj, name)
            except Refusal as refusal:
                if refusal.code == RefusalCode.MISSING_SHARD:
                    return False
                problem = str(refusal)
        if problem is None:
            return self.renew_object(name)
        self._set_aside(key, f"{name}-{int(time.time())}-{secrets.token_hex(4)}", f"object {name}", problem)
        return False

    def _set_aside(self, key: str, aside: str, what: str, problem: str) -> bool:
        """Copy ``key`` to quarantine/``aside`` (evidence), then delete it if unchanged: False if it was gone."""
        target = self.key(L.QUARANTINE, aside)
        try:
            self.client.copy_object(Bucket=self.bucket, Key=target, CopySource={"Bucket": self.bucket, "Key": key})
        except self._errors as exc:
            if _absent(exc):
                return False
            raise self._fail("set-aside", key, exc) from exc
        removed = self._delete_if_unchanged(key)
        if removed:
            logger.warning("store %s: %s %s; set aside as %s/%s", self.location, what, problem, L.QUARANTINE, aside)
        return removed

    def has_object(self, name: str) -> bool:
        return self._head(self._object_key(name)) is not None

    def open_object(self, name: str, what: str) -> ObjectFile:
        """The object in this process's memory, read by ranged GETs in parallel (each pinned to the ETag the
        first one saw, so a replaced object is never read half old, half new)."""
        key = self._object_key(name)
        try:
            first = self._get(key, Range=f"bytes=0-{READ_PART_BYTES - 1}")
        except self._errors as exc:
            code, status = _error(exc)
            if status == 416:  # an empty object: no byte to range over
                first = self._get(key)
            else:
                raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {name} cannot be read from the store "
                                                         f"{self.location}: {code or type(exc).__name__}") from None
        if first is None:
            raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {name} is missing from the store")
        total = _object_size(first)
        obj = ObjectFile.in_memory(total, name)
        view = obj.fill_view()
        try:
            if total:
                self._read_body(first["Body"], view[:min(total, READ_PART_BYTES)], what, name)
                rest = part_ranges(total, READ_PART_BYTES)[1:]
                list(self._parts.map(lambda r: self._read_range(key, first["ETag"], r, view, what, name), rest))
        except BaseException:
            view.release()  # first: an exported view keeps the memory from being unmapped
            obj.close()
            raise
        view.release()
        return obj

    def open_objects(self, wanted: Sequence[tuple[str, int]], what: str) -> list[ObjectFile]:
        """Every object's ranges asked for at once, ``PART_THREADS`` GETs in flight, in the order wanted; the
        objects are returned while their bytes arrive. A read of one (``view``, ``populate``) waits for that
        object alone, so a restore verifies the first objects while the next ones download. The sizes come
        from the records: no range waits for a first GET to learn one. Every range of one object must answer
        with one ETag (an object replaced while being read is refused, never read half old, half new), and
        each object is still checked against its digest above. A missing object, or one of another size, is
        refused by the first read of it.

        The first range of every object is asked for before the others: a restore reads every object's head
        (in its first range) before it verifies any payload, and heads queued behind whole objects kept the
        verification from starting until almost every byte had arrived (measured on 1 GiB: 0.2 s of
        hashing left after the last range)."""
        files: list[ObjectFile] = []
        try:
            ranges = []
            for name, size in wanted:
                if not size:  # an empty object has no range to ask for
                    files.append(self.open_object(name, what))
                    check_opened_size(files[-1], size, f"{what} {name[:16]}...")
                    continue
                files.append(ObjectFile.in_memory(size, name))
                ranges.append(_Ranges(self, files[-1], what))
                files[-1].arriving(ranges[-1])
                ranges[-1].ask(first=True)
            for arrival in ranges:
                arrival.ask(first=False)
            return files
        except BaseException:
            for obj in files:
                obj.close()
            raise

    def _read_sized(self, obj: ObjectFile, view: memoryview, span: tuple[int, int], what: str) -> str:
        """Bytes ``span`` of the object ``obj`` is to hold (its name, of its size), into ``view[span]``; the
        ETag they came with. A Refusal ``format`` where the object has another size, ``missing-shard`` where
        it is absent."""
        name, size = obj.digest, obj.size
        lo, hi = span
        obj.prepare_fill(lo, hi - lo)
        try:
            got = self._get(self._object_key(name), Range=f"bytes={lo}-{hi - 1}")
        except self._errors as exc:
            code, status = _error(exc)
            if status == 416:  # the range starts past the object's end
                raise Refusal(RefusalCode.FORMAT, f"{what} {name[:16]}... is shorter than the {size} bytes its "
                                                  "record says (truncated)") from None
            raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {name} cannot be read from the store "
                                                     f"{self.location}: {code or type(exc).__name__}") from None
        if got is None:
            raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {name} is missing from the store")
        total = _object_size(got)
        if total != size:
            got["Body"].close()
            raise Refusal(RefusalCode.FORMAT, f"{what} {name[:16]}... has {total} bytes, its record says {size} "
                                              "(truncated or extended)")
        self._read_body(got["Body"], view[lo:hi], what, name)
        return got["ETag"]

    def _read_range(self, key: str, etag: str, span: tuple[int, int], view: memoryview, what: str, name: str) -> None:
        lo, hi = span
        try:
            got = self._get(key, Range=f"bytes={lo}-{hi - 1}", IfMatch=etag)
        except self._errors as exc:
            raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {name} changed or went while being read "
                                                     f"({_error(exc)[0] or type(exc).__name__})") from None
        if got is None:
            raise Refusal(RefusalCode.MISSING_SHARD, f"{what} {name} went while being read")
        self._read_body(got["Body"], view[lo:hi], what, name)

    @staticmethod
    def _read_body(body, into: memoryview, what: str, name: str) -> None:
        """A response body into ``into``, which it must fill exactly."""
        # Straight from the socket into place where the HTTP response can (urllib3's readinto): no
        # temporary bytes to allocate and copy under the GIL. The length is checked here either way.
        raw = getattr(body, "_raw_stream", None)
        readinto = getattr(raw, "readinto", None)
        done = 0
        while done < len(into):
            if readinto is not None:
                got = readinto(into[done:done + 4 * MIB])
            else:
                chunk = body.read(min(len(into) - done, 4 * MIB))
                got = len(chunk)
                into[done:done + got] = chunk
            if not got:
                raise Refusal(RefusalCode.CORRUPT_SHARD, f"{what} {name}: the store sent {done} bytes of {len(into)}")
            done += got
        body.close()

    def read_object(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            got = self._get(self._object_key(name), Range=f"bytes={offset}-{offset + length - 1}")
        except self._errors as exc:
            if _error(exc)[1] == 416:
                return b""
            raise
        if got is None:
            raise Refusal(RefusalCode.MISSING_SHARD, f"object {name} is missing from the store")
        return got["Body"].read()

    def _list(self, prefix: str, delimiter: str | None = None) -> Iterator[dict]:
        """Every page of a listing under ``prefix`` (gc and alpha-ckpt only: never a save or a restore)."""
        pages = self.client.get_paginator("list_objects_v2")
        kw = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kw["Delimiter"] = delimiter
        yield from pages.paginate(**kw)

    def list_objects(self, on_hostile: Callable[[str, str], None] | None = None) -> Iterator[str]:
        base = self.key(L.OBJECTS) + "/"
        names = []
        for page in self._list(base):
            for entry in page.get("Contents", ()):
                rest = entry["Key"][len(base):]
                fan, _, name = rest.partition("/")
                if FAN_NAME_RE.match(fan) and is_digest(name) and fan_of(name) == fan:
                    names.append(name)
                elif on_hostile is not None:
                    on_hostile(f"{L.OBJECTS}/{rest}", "not an object of this store")
        return iter(sorted(names))

    def renew_object(self, name: str) -> bool:
        """Mark the object used now, by the server's clock (its marker's time), so gc spares it; False if it
        is gone (or going). The marker is written before gc's doomed marker is looked for, and gc writes
        its marker before it reads this one (:mod:`alpha_ckpt.store.s3_sweep`): where the two meet, this
        waits for gc to finish and answers whether the object stayed."""
        key = self.key(RENEWED, name)
        deadline = time.monotonic() + 2 * DOOM_BOUND_S
        while True:
            if not self.has_object(name):
                return False
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=b"")
            except self._errors as exc:
                raise self._fail("renew", key, exc) from exc
            doomed = self._head(self.key(DOOMED, name))
            if doomed is None or self._age(doomed) > DOOM_BOUND_S or time.monotonic() > deadline:
                return self.has_object(name)
            time.sleep(0.2)  # a gc is deciding about this object: its answer is the object there or gone

    def _age(self, head: dict) -> float:
        """Seconds since a key was put, by the server's clock (its reply's Date)."""
        date = head["ResponseMetadata"]["HTTPHeaders"].get("date")
        now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
        return now - head["LastModified"].timestamp()

    def delete_object(self, name: str) -> bool:
        return self._delete_if_unchanged(self._object_key(name))

    # ------------------------------------------------------------ refs

    def ref_dir(self, run: str, step: str, create: bool) -> "S3RefDir | None":
        refs = S3RefDir(self, run, step)
        if create or refs.top() > 0:
            return refs
        return None

    def runs(self) -> list[tuple[str, str]]:
        base = self.key(L.REFS) + "/"
        out = []
        for page in self._list(base, "/"):
            for run_prefix in page.get("CommonPrefixes", ()):
                run = run_prefix["Prefix"][len(base):].rstrip("/")
                for steps in self._list(run_prefix["Prefix"], "/"):
                    for step_prefix in steps.get("CommonPrefixes", ()):
                        out.append((run, step_prefix["Prefix"][len(run_prefix["Prefix"]):].rstrip("/")))
        return sorted(out)

    def close(self) -> None:
        self._parts.shutdown(wait=False)


class _Ranges:
    """The ranged GETs filling one object in memory (:meth:`S3Backend.open_objects`)."""

    def __init__(self, backend: S3Backend, obj: ObjectFile, what: str):
        self.what, self.name = what, obj.digest
        self._backend, self._obj = backend, obj
        self._view = obj.fill_view()
        self._spans = part_ranges(obj.size, READ_PART_BYTES)
        self._futures: list[Future] = []
        self._refusal: Refusal | None = None
        self._done = False

    def ask(self, first: bool) -> None:
        """Submit the GET of the object's first range (``first``), or of every other range."""
        backend = self._backend
        self._futures += [backend._parts.submit(backend._read_sized, self._obj, self._view, span, self.what)
                          for span in (self._spans[:1] if first else self._spans[1:])]

    def wait(self, offset: int = 0, length: int | None = None) -> None:
        if length is not None and not self._done:  # a range: its own GETs (a failed one: the whole verdict)
            covering = [f for (lo, hi), f in zip(self._spans, self._futures) if lo < offset + length and offset < hi]
            wait(covering)
            if all(f.exception() is None for f in covering):
                return
        if not self._done:
            wait(self._futures)
            self._done = True
            self._view.release()
            failed = next((f.exception() for f in self._futures if f.exception() is not None), None)
            if isinstance(failed, Refusal):
                self._refusal = failed
            elif failed is not None:
                self._refusal = Refusal(RefusalCode.MISSING_SHARD, f"{self.what} {self.name} cannot be read: "
                                                                   f"{type(failed).__name__}: {failed}")
            elif len({f.result() for f in self._futures}) > 1:
                self._refusal = Refusal(RefusalCode.MISSING_SHARD, f"{self.what} {self.name} changed while being "
                                                                   "read")
        if self._refusal is not None:
            raise Refusal(self._refusal.code, self._refusal.message)

    def abandon(self) -> None:
        if not self._done:
            for future in self._futures:
                future.cancel()
            wait(self._futures)
            self._done = True
            self._view.release()
            if self._refusal is None:
                self._refusal = Refusal(RefusalCode.MISSING_SHARD, f"{self.what} {self.name}: its read was abandoned")


class S3RefDir(RefDir):
    """The refs of one (run, step): put only if the number is free, found without a listing."""

    def __init__(self, backend: S3Backend, run: str, step: str):
        self._b, self._run, self._step = backend, run, step

    def _key(self, name: str) -> str:
        return self._b.key(L.REFS, self._run, self._step, name)

    def numbers(self) -> list[int]:
        base = self._b.key(L.REFS, self._run, self._step) + "/"
        out = []
        for page in self._b._list(base):
            for entry in page.get("Contents", ()):
                name = entry["Key"][len(base):]
                if REF_NAME_RE.match(name):
                    out.append(int(name))
        return sorted(out)

    def _hint(self) -> tuple[int, int, str | None]:
        """The head hint: (the highest number known taken, the lowest number that may still be present, its
        ETag), or (0, 1, None) where there is none."""
        got = self._b._get(self._key(HEAD_HINT))
        if got is None:
            return 0, 1, None
        words = got["Body"].read(64).decode("ascii", "replace").split()
        numbers = [int(w) for w in words if w.isdigit()]
        top = numbers[0] if numbers else 0
        floor = numbers[1] if len(numbers) > 1 else 1
        return top, max(1, floor), got["ETag"]

    def top(self) -> int:
        """The highest number taken: the hint's, then each number above it probed until one is free."""
        return self.newest_first()[0]

    def newest_first(self, whole: bool = False) -> tuple[int, Iterator[int]]:
        """The numbers from the top down to the hint's floor (below it, every ref was deleted), without a
        listing; for the whole history, their refs are fetched in parallel first."""
        top, floor, _ = self._hint()
        while self._b._head(self._key(ref_name(top + 1))) is not None:
            top += 1
        numbers = range(top, floor - 1, -1)
        if whole:
            self._fetched = dict(zip(numbers, self._b._parts.map(self._fetch, numbers)))
        return top, iter(numbers)

    def _fetch(self, generation: int) -> bytes | None | RefUnreadable:
        try:
            return self._read(generation)
        except RefUnreadable as unreadable:
            return unreadable

    def read(self, generation: int) -> bytes | None:
        fetched = getattr(self, "_fetched", {}).pop(generation, False)
        if fetched is False:
            return self._read(generation)
        if isinstance(fetched, RefUnreadable):
            raise fetched
        return fetched

    def _read(self, generation: int) -> bytes | None:
        got = self._b._get(self._key(ref_name(generation)))
        if got is None:
            return None
        body = got["Body"].read(MAX_REF_BYTES + 1)
        if len(body) > MAX_REF_BYTES:
            raise RefUnreadable("too large to be a ref", True)
        return body

    def put(self, generation: int, body: bytes) -> None:
        key = self._key(ref_name(generation))
        if not self._b._put_if_absent(key, body, kind="ref"):
            # Taken: by another publisher, or by this very put whose reply was lost and was retried. The
            # bytes tell which (a ref names its publisher's root, prefix and time).
            if self._read(generation) != bytes(body):
                raise FileExistsError(errno.EEXIST, f"ref {self._run}/{self._step}/{ref_name(generation)} is taken")
        self._raise_hint(top=generation)

    def _raise_hint(self, top: int = 0, floor: int = 0) -> None:
        """Raise the hint's top or floor (compare-and-swap on its ETag: neither ever goes down). Best effort:
        a stale top costs a probe more, never a wrong head (the numbers above it are probed)."""
        key = self._key(HEAD_HINT)
        for _ in range(CONFLICT_RETRIES + 1):
            known_top, known_floor, etag = self._hint()
            if known_top >= top and known_floor >= floor:
                return
            body = f"{max(top, known_top)} {max(floor, known_floor)}\n".encode()
            try:
                if etag is None:
                    self._b.client.put_object(Bucket=self._b.bucket, Key=key, Body=body, IfNoneMatch="*")
                else:
                    self._b.client.put_object(Bucket=self._b.bucket, Key=key, Body=body, IfMatch=etag)
                return
            except self._b._errors as exc:
                if not (_taken(exc) or _conflict(exc)):
                    logger.debug("store %s: head hint of %s/%s not raised (%s)", self._b.location, self._run,
                                 self._step, _error(exc)[0])
                    return

    def raise_floor(self) -> None:
        """Raise the floor past every number at its bottom that is free now (after gc removed refs)."""
        top, floor, _ = self._hint()
        start = floor
        while floor < top and self._b._head(self._key(ref_name(floor))) is None:
            floor += 1
        if floor > start:
            self._raise_hint(floor=floor)

    def delete(self, generation: int) -> bool:
        removed = self._b._delete_if_unchanged(self._key(ref_name(generation)))
        self.raise_floor()  # where it was the lowest, a history walk need not read its number again
        return removed

    def set_aside(self, generation: int, aside: str, what: str) -> bool:
        moved = self._b._set_aside(self._key(ref_name(generation)), aside, what, "cannot be read")
        self.raise_floor()
        return moved

    def close(self) -> None:
        pass
