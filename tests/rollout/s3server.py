"""A real S3 endpoint on loopback for release-store tests, and a proxy that injects faults.

``MotoS3`` runs moto's server in a child process (its own GIL: roughly twice the request rate of
moto's in-process ``ThreadedMotoServer``). ``FaultProxy`` sits between boto3 and that server and
fails, delays or drops chosen requests at the HTTP level, so the code under test meets the same
errors, timeouts and lost answers it would meet in production, with no mock of boto3.

    with MotoS3() as s3, FaultProxy(s3.endpoint) as proxy:
        bucket = s3.make_bucket()
        proxy.fail(method="PUT", key_pattern=r"manifest\\.json$", status=503)
        proxy.client(retries={"total_max_attempts": 1}).put_object(...)  # -> ClientError SlowDown

Note botocore's ``retries={"max_attempts": n}`` counts retries, in every mode (n=1 still retries
once); ``total_max_attempts`` counts every attempt.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import logging
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, NamedTuple, NoReturn
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)

# Runs in the child. The port comes from the OS and is printed once, so no other process can take
# it between choosing and binding; stdin closing means the test process died, so the server goes
# too (atexit does not run on SIGKILL).
_CHILD = r"""
import logging, os, sys, threading
from werkzeug.serving import make_server
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication, MotoRequestHandler, create_backend_app)

logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no access log per request
server = make_server(sys.argv[1], 0, DomainDispatcherApplication(create_backend_app),
                     threaded=True, request_handler=MotoRequestHandler)
os.environ["MOTO_PORT"] = str(server.port)

def _orphaned():
    sys.stdin.buffer.read()
    os._exit(0)

threading.Thread(target=_orphaned, daemon=True).start()
print(server.port, flush=True)
server.serve_forever()
"""

_HOST = "127.0.0.1"


def s3_client(endpoint: str, **config: Any):
    """boto3 S3 client for ``endpoint`` with dummy credentials, path-style addressing.

    ``config`` goes to ``botocore.config.Config`` (``retries``, ``read_timeout``, ...).
    """
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(**{"s3": {"addressing_style": "path"}, **config}),
    )


class MotoS3:
    """moto's S3 server in a child process on 127.0.0.1, on a port the OS chose."""

    def __init__(self, start_timeout: float = 15.0) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115  (the child's stderr for the server's life; close() closes it)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, _HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr
        )
        atexit.register(self.close)
        try:
            port = self._read_port(start_timeout)
            self.endpoint = f"http://{_HOST}:{port}"
            self._wait_answering(start_timeout)
        except BaseException:
            self.close()
            raise

    def _read_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._proc.stdout], [], [], 0.1)
            if ready:
                line = self._proc.stdout.readline()
                if line.strip().isdigit():
                    return int(line)
                self._fail_start(f"printed {line!r} instead of its port")
            if self._proc.poll() is not None:
                self._fail_start(f"exited with status {self._proc.returncode}")
        self._fail_start(f"printed no port within {timeout:.0f} s")

    def _wait_answering(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # it answered
            except OSError:
                if self._proc.poll() is not None:
                    self._fail_start(f"exited with status {self._proc.returncode}")
                time.sleep(0.05)
        self._fail_start(f"did not answer on {self.endpoint} within {timeout:.0f} s")

    def _fail_start(self, what: str) -> NoReturn:
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace")[-3000:]
        raise RuntimeError(f"moto server {what}; is moto[server] installed in {sys.executable}?\nits stderr:\n{tail}")

    def client(self, **config: Any):
        """boto3 S3 client straight to moto (no faults); see `s3_client`."""
        return s3_client(self.endpoint, **config)

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a unique valid name unless given) and return its name."""
        name = name or f"skuforge-test-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def reset(self) -> None:
        """Forget every bucket and object (moto's /moto-api/reset)."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=10):
            pass

    def close(self) -> None:
        """Stop the server; safe to call twice."""
        atexit.unregister(self.close)
        proc = self._proc
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for pipe in (proc.stdin, proc.stdout):
            pipe.close()
        self._stderr.close()

    def __enter__(self) -> MotoS3:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the fault proxy ------------------------------------------------------------------------------

FaultKind = Literal["fail", "delay", "drop"]

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}

_MESSAGES = {
    "SlowDown": "Please reduce your request rate.",
    "InternalError": "We encountered an internal error. Please try again.",
    "ServiceUnavailable": "Service is unable to handle request.",
    "PreconditionFailed": "At least one of the pre-conditions you specified did not hold",
    "NoSuchKey": "The specified key does not exist.",
    "AccessDenied": "Access Denied",
}


class Seen(NamedTuple):
    """One request as it reached the proxy: method and target (path and query, as sent)."""

    method: str
    path: str

    @property
    def key(self) -> str | None:
        return object_key(self.path)


def object_key(target: str) -> str | None:
    """The object key of a path-style request target, or None for a bucket or service request."""
    parts = urlsplit(target).path.split("/", 2)
    return unquote(parts[2]) if len(parts) == 3 and parts[2] else None


@dataclass
class _Rule:
    kind: FaultKind
    methods: frozenset[str] | None
    key_pattern: re.Pattern[str] | None
    times: int | None  # None: until clear()
    status: int = 503
    code: str = "SlowDown"
    message: str | None = None
    seconds: float = 0.0
    after_body: bool = False

    def matches(self, method: str, key: str | None) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        return self.key_pattern is None or (key is not None and bool(self.key_pattern.search(key)))


def _methods(method: str | Iterable[str] | None) -> frozenset[str] | None:
    if method is None:
        return None
    return frozenset([method.upper()] if isinstance(method, str) else (m.upper() for m in method))


class FaultProxy:
    """HTTP/1.1 reverse proxy on 127.0.0.1 in front of ``target`` that injects S3 faults.

    Requests are forwarded unchanged (Host included: SigV4 signs it, and moto routes path-style
    requests whatever the host). Fault rules are tried in the order added; the first that matches
    a request and has ``times`` left applies to it. ``method`` is one method or several;
    ``key_pattern`` is a regex searched in the URL-decoded object key (after ``/bucket/``) and
    never matches bucket-level requests; ``times=None`` means until `clear`.
    """

    def __init__(self, target: str) -> None:
        url = urlsplit(target)
        self.target = (url.hostname or _HOST, url.port or 80)
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._seen: list[Seen] = []
        self._wakeup = threading.Event()  # set by clear()/close(): held requests are dropped
        self._connections: set[socket.socket] = set()
        self._server = _Server((_HOST, 0), _Handler)
        self._server.proxy = self
        self.endpoint = f"http://{_HOST}:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"FaultProxy {self.endpoint}",
            daemon=True,
        )
        self._thread.start()

    # -- programming faults

    def fail(
        self,
        method: str | Iterable[str] | None = None,
        key_pattern: str | None = None,
        status: int = 503,
        times: int | None = 1,
        code: str = "SlowDown",
        message: str | None = None,
    ) -> None:
        """Answer matching requests with ``status`` and an S3 XML error, without reaching moto."""
        self._add(
            _Rule("fail", _methods(method), _compile(key_pattern), times, status=status, code=code, message=message)
        )

    def delay(
        self,
        seconds: float,
        method: str | Iterable[str] | None = None,
        key_pattern: str | None = None,
        times: int | None = 1,
        after_body: bool = False,
    ) -> None:
        """Hold matching requests ``seconds`` before forwarding them (to cause client timeouts).

        The request still reaches moto after the hold, even when the client has given up (as a slow
        network would do). ``after_body=True`` forwards first and holds the answer: moto applied
        the request, the client times out. A request still held when `clear` or `close` runs is
        dropped, never forwarded.
        """
        self._add(
            _Rule("delay", _methods(method), _compile(key_pattern), times, seconds=seconds, after_body=after_body)
        )

    def drop(
        self,
        method: str | Iterable[str] | None = None,
        key_pattern: str | None = None,
        times: int | None = 1,
        after_body: bool = False,
    ) -> None:
        """Close the connection of matching requests without an answer.

        ``after_body=True`` forwards the request to moto first: the write is applied but the
        client never hears back (the lost answer).
        """
        self._add(_Rule("drop", _methods(method), _compile(key_pattern), times, after_body=after_body))

    def clear(self) -> None:
        """Remove all fault rules, forget the requests seen, drop requests still held."""
        with self._lock:
            self._rules.clear()
            self._seen.clear()
            self._wakeup.set()
            self._wakeup = threading.Event()

    # -- what happened

    @property
    def requests(self) -> list[Seen]:
        """The requests seen since the start or the last `clear`, oldest first (a copy)."""
        with self._lock:
            return list(self._seen)

    def count(self, method: str | Iterable[str] | None = None, key_pattern: str | None = None) -> int:
        """How many requests seen match, with the same matching as the fault rules."""
        rule = _Rule("fail", _methods(method), _compile(key_pattern), None)
        return sum(rule.matches(seen.method, seen.key) for seen in self.requests)

    def client(self, **config: Any):
        """boto3 S3 client through the proxy; see `s3_client`."""
        return s3_client(self.endpoint, **config)

    def close(self) -> None:
        """Stop listening and cut every open connection; safe to call twice."""
        self._wakeup.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by the handler

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def _take(self, method: str, target: str) -> tuple[_Rule | None, threading.Event]:
        """Record the request and consume one use of the first rule that matches it."""
        key = object_key(target)
        with self._lock:
            self._seen.append(Seen(method, target))
            for rule in self._rules:
                if rule.matches(method, key):
                    if rule.times is not None:
                        rule.times -= 1
                        if rule.times <= 0:
                            self._rules.remove(rule)
                    return rule, self._wakeup
            return None, self._wakeup


def _compile(pattern: str | None) -> re.Pattern[str] | None:
    return None if pattern is None else re.compile(pattern)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # the client gave up (a timeout under test): nothing to report
        log.exception("FaultProxy: error while serving %s", client_address)


class _Dropped(Exception):
    """The connection is to be closed without an answer."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as boto3 expects
    # An answer is written as its headers, then its body: with Nagle's algorithm on, the body waits
    # for the client's delayed ACK of the headers, 40 ms on every GET and LIST (48 ms a request
    # through the proxy against 5.6 ms straight to moto; PUT answers have no body to hold back)
    disable_nagle_algorithm = True
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def setup(self) -> None:
        super().setup()
        with self.server.proxy._lock:
            self.server.proxy._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.proxy._lock:
            self.server.proxy._connections.discard(self.connection)
        if self._upstream is not None:
            self._upstream.close()
        with contextlib.suppress(ConnectionError):
            super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("FaultProxy: " + format, *args)

    def _serve(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        rule, wakeup = proxy._take(self.command, self.path)
        try:
            if rule is None:
                self._answer(*self._forward(body))
            elif rule.kind == "fail":
                self._answer_error(rule)
            elif rule.kind == "delay":
                if rule.after_body:
                    answer = self._forward(body)
                    self._hold(rule.seconds, wakeup)
                    self._answer(*answer)
                else:
                    self._hold(rule.seconds, wakeup)
                    self._answer(*self._forward(body))
            else:
                if rule.after_body:
                    self._forward(body)
                raise _Dropped
        except _Dropped:
            self.close_connection = True
        except ConnectionError:
            self.close_connection = True  # the client went away meanwhile

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = _serve

    def _hold(self, seconds: float, wakeup: threading.Event) -> None:
        if wakeup.wait(seconds):
            raise _Dropped

    def _read_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = self.headers.get("Content-Length")
        return self.rfile.read(int(length)) if length is not None else None

    def _forward(self, body: bytes | None) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """Send the request to the target as received; return its answer (status, reason,
        headers, body). An error reaching the target answers 502."""
        headers = [
            (k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"
        ]
        if body is not None:
            headers.append(("Content-Length", str(len(body))))
        for attempt in range(2):
            reused = self._upstream is not None
            conn = self._upstream or http.client.HTTPConnection(*self.server.proxy.target, timeout=60)
            self._upstream = None
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    conn.putheader(name, value)
                conn.endheaders(body)
                resp = conn.getresponse()
                data = resp.read()
            except (ConnectionError, http.client.HTTPException) as exc:
                conn.close()
                if reused and attempt == 0:
                    continue  # an idle keep-alive connection the target had closed
                rule = _Rule(
                    "fail",
                    None,
                    None,
                    None,
                    status=502,
                    code="BadGateway",
                    message=f"FaultProxy could not reach {self.server.proxy.target}: {exc}",
                )
                return _error_answer(rule, self.path, self.command)
            if resp.will_close:
                conn.close()
            else:
                self._upstream = conn
            return resp.status, resp.reason, resp.getheaders(), data
        raise AssertionError("unreachable")

    def _answer(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes) -> None:
        self.send_response_only(status, reason)
        for name, value in headers:
            lower = name.lower()
            if lower in _HOP_BY_HOP or (lower == "content-length" and self.command != "HEAD"):
                continue
            self.send_header(name, value)
        if self.command != "HEAD" and status >= 200 and status not in (204, 304):
            self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _answer_error(self, rule: _Rule) -> None:
        self._answer(*_error_answer(rule, self.path, self.command))


def _error_answer(rule: _Rule, target: str, method: str) -> tuple[int, str, list[tuple[str, str]], bytes]:
    from xml.sax.saxutils import escape

    request_id = uuid.uuid4().hex[:16].upper()
    message = rule.message or _MESSAGES.get(rule.code, "Injected by FaultProxy.")
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(rule.code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(urlsplit(target).path)}</Resource>"
        f"<RequestId>{request_id}</RequestId></Error>"
    ).encode()
    headers = [("Content-Type", "application/xml"), ("x-amz-request-id", request_id)]
    if method == "HEAD":
        headers.append(("Content-Length", "0"))  # S3 sends no error body to HEAD
    return rule.status, http.client.responses.get(rule.status, ""), headers, body
