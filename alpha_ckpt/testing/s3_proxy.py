"""An HTTP proxy in front of an S3 server, for tests and benchmarks: it counts the requests by kind (PUT,
GET, HEAD, POST, DELETE, and LIST for a listing), as the server sees them and not as the product reports
them, and it can inject faults into chosen requests (a 503 SlowDown, a stall, a dropped reply after the
server acted, a corrupted body).

    proxy = S3Proxy(server.endpoint).start()
    env["AWS_ENDPOINT_URL"] = proxy.endpoint
    ...
    proxy.counts["LIST"]
    proxy.inject(Fault("slowdown", method="PUT", times=3))
"""
from __future__ import annotations

import http.client
import http.server
import socketserver
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

_HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}


def request_kind(method: str, path: str) -> str:
    """What a request is: LIST for a listing of a bucket (objects or uploads), else its method."""
    parts = urlsplit(path)
    query = parse_qs(parts.query, keep_blank_values=True)
    key = parts.path.lstrip("/").partition("/")[2]
    if method == "GET" and not key and ("list-type" in query or "prefix" in query or "uploads" in query
                                        or "delimiter" in query or not parts.query):
        return "LIST"
    return method


@dataclass
class Fault:
    """A fault for the next ``times`` requests that match ``method`` (and ``key_contains`` in their path):
    ``slowdown`` answers 503 SlowDown without forwarding; ``stall`` waits ``seconds`` before forwarding;
    ``drop_reply`` forwards, then closes the connection without answering (the server acted, the client
    never hears); ``corrupt_body`` flips a byte of the request body before forwarding; ``strip_conditions``
    forwards without its If-None-Match and If-Match headers (a server that ignores conditional writes)."""

    kind: str
    method: str | None = None
    key_contains: str = ""
    times: int = 1
    seconds: float = 0.0
    hits: int = field(default=0)

    def matches(self, method: str, path: str) -> bool:
        return self.hits < self.times and (self.method is None or self.method == method) \
            and self.key_contains in path


class S3Proxy:
    """A threaded proxy on 127.0.0.1 forwarding to ``upstream`` (http://HOST:PORT)."""

    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream).netloc
        self.counts: Counter = Counter()
        self.faults: list[Fault] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                kind = request_kind(self.command, self.path)
                with proxy.lock:
                    proxy.counts[kind] += 1
                    fault = next((f for f in proxy.faults if f.matches(self.command, self.path)), None)
                    if fault is not None:
                        fault.hits += 1
                if fault is not None and fault.kind == "slowdown":
                    reply = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                             b'<Message>Please reduce your request rate.</Message></Error>')
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                if fault is not None and fault.kind == "stall":
                    time.sleep(fault.seconds)
                if fault is not None and fault.kind == "corrupt_body" and body:
                    body = body[:len(body) // 2] + bytes([body[len(body) // 2] ^ 0xFF]) + body[len(body) // 2 + 1:]
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                if fault is not None and fault.kind == "strip_conditions":
                    headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=300)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                if fault is not None and fault.kind == "drop_reply":
                    self.close_connection = True
                    return
                self.send_response(response.status, response.reason)
                # A HEAD's Content-Length is the object's size, not the empty body's: clients size reads by it.
                for k, v in response.getheaders():
                    if k.lower() not in _HOP_HEADERS and (k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request, client_address) -> None:
                pass  # a client that gave up on a held request: what the faults are for, not news

        self._server = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)

    def start(self) -> "S3Proxy":
        self._thread.start()
        return self

    def inject(self, fault: Fault) -> Fault:
        with self.lock:
            self.faults.append(fault)
        return fault

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()
            self.faults.clear()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "S3Proxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
