"""`peerflow sandbox serve`: this machine's sandbox as a `run_code` HTTP service.

It answers the Sandbox Fusion route `POST /run_code` (`peerflow.sandbox.remote` has the
shapes) from a local sandbox (bubblewrap by default), so code execution can live on a
machine of its own and trainers reach it with `sandbox.backend: remote`.

What it refuses (the service runs whatever it is sent, so every request is an attacker's
until proven otherwise):

* no token: every request must carry `Authorization: Bearer <token>`, on loopback too (any
  local account could reach a loopback port); without one given, `make_server` makes one
  (`secrets`). The header is compared as bytes (`hmac.compare_digest`), so a header that
  is not ASCII is a 401 like any wrong token. Answer: 401.
* limits outside `(0, cap]`: `run_timeout` and `memory_limit_MB` must be finite positive
  numbers (absent or `null`: the cap); above the cap they are lowered to it. Answer: 400
  naming the field, as for a body that is not a JSON object or a `code` that is not text.
* a body over `ServeLimits.max_body_bytes` (413) or without a `Content-Length` (411).
* a request that does not arrive whole within `ServeLimits.read_timeout_s` (headers and
  body together, however slowly it trickles): the connection is closed.
* more than `ServeLimits.workers` programs at once: a request waits up to
  `ServeLimits.queue_s` for a worker, then is answered 503 with `Retry-After`; more than
  `ServeLimits.max_connections` connections at once are answered 503 when accepted. An
  answer is never a reset: an early refusal drains what the client is still sending
  before closing.

The standard library's threading HTTP server, not uvicorn: the service needs a deadline
on reading a whole request, which uvicorn does not offer, and the programs it runs block a
thread each anyway. Bound to 127.0.0.1 unless told otherwise; the address family follows
the host (`::1` binds IPv6).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import os
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from typing import Any

import attrs

from peerflow.sandbox.base import Sandbox, SandboxLimits, SandboxUnavailableError

#: Bytes an early refusal reads (at most) of what the client is still sending.
DRAIN_BYTES = 1 << 20


@attrs.frozen(kw_only=True)
class ServeLimits:
    """What one `peerflow sandbox serve` accepts."""

    cap: SandboxLimits = SandboxLimits(timeout_s=60.0, memory_mb=4096)
    """The most a request may ask for; its process and output limits are the cap's."""
    workers: int = attrs.field(factory=lambda: max(1, os.cpu_count() or 1))
    """Programs run at once (default: one per CPU)."""
    queue_s: float = 30.0
    """Seconds a request waits for a free worker before it is answered 503."""
    max_connections: int = 64
    """Connections served at once; one more is answered 503 when accepted."""
    max_body_bytes: int = 16 << 20
    """Largest request body (program and stdin together); larger: 413."""
    read_timeout_s: float = 10.0
    """Seconds a request has to arrive whole (headers and body); later: closed."""

    def __attrs_post_init__(self) -> None:
        """Refuses a limit that would switch its check off."""
        for name in ("workers", "max_connections", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeLimits.{name}={getattr(self, name)}: must be >= 1")
        if not (math.isfinite(self.queue_s) and self.queue_s >= 0):
            raise ValueError(f"ServeLimits.queue_s={self.queue_s}: must be a finite number >= 0")
        if not (math.isfinite(self.read_timeout_s) and self.read_timeout_s > 0):
            raise ValueError(f"ServeLimits.read_timeout_s={self.read_timeout_s}: must be a "
                             "finite number > 0")


class BadRequestError(ValueError):
    """A request the service refuses with 400; the message names the field."""


def _limit(request: dict[str, Any], field: str, cap: float) -> float:
    """`request[field]` within `(0, cap]` (absent or `null`: `cap`)."""
    value = request.get(field)
    if value is None:
        return cap
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequestError(f"{field}={value!r}: must be a number in (0, {cap:g}]")
    if not (math.isfinite(value) and value > 0):
        raise BadRequestError(f"{field}={value!r}: must be a finite number > 0 (at most "
                              f"{cap:g}; leave it out for {cap:g})")
    return min(value, cap)


def parse_request(request: Any, cap: SandboxLimits) -> tuple[str, str, SandboxLimits]:
    """The program, its stdin and its limits from a `run_code` body.

    Raises:
        BadRequestError: the body is not a JSON object, a field has the wrong type, or a
            limit is not a finite positive number (limits above `cap` are lowered to it).
    """
    if not isinstance(request, dict):
        raise BadRequestError(f"the body must be a JSON object, not {type(request).__name__}")
    if request.get("language", "python") != "python":
        raise BadRequestError(f"language={request.get('language')!r}: only python is served")
    code, stdin = request.get("code", ""), request.get("stdin")
    stdin = "" if stdin is None else stdin
    for field, value in (("code", code), ("stdin", stdin)):
        if not isinstance(value, str):
            raise BadRequestError(f"{field} must be a string, not {type(value).__name__}")
    limits = SandboxLimits(
        timeout_s=float(_limit(request, "run_timeout", cap.timeout_s)),
        memory_mb=max(1, int(_limit(request, "memory_limit_MB", cap.memory_mb))),
        max_processes=cap.max_processes, max_output_mb=cap.max_output_mb)
    return code, stdin, limits


def run_request(sandbox: Sandbox, code: str, stdin: str, limits: SandboxLimits
                ) -> dict[str, Any]:
    """Runs one program; the `run_code` reply."""
    try:
        result = sandbox.run(code, stdin, limits)
    except SandboxUnavailableError as exc:
        return {"status": "SandboxError", "message": str(exc)}
    run_status = {"ok": "Finished", "error": "Finished", "timeout": "TimeLimitExceeded"}
    return {"status": "Success" if result.status == "ok" else "Failed", "message": "",
            "run_result": {"status": run_status[result.status],
                           "return_code": result.returncode, "stdout": result.stdout,
                           "stderr": result.stderr}}


def _error(message: str) -> dict[str, Any]:
    return {"status": "SandboxError", "message": message}


class RunCodeHandler(BaseHTTPRequestHandler):
    """One connection: one `POST /run_code` (HTTP/1.0, closed after the answer)."""

    server: SandboxServer

    def setup(self) -> None:
        """Arms the deadline for the whole request (`ServeLimits.read_timeout_s`)."""
        self.timeout = self.server.limits.read_timeout_s
        super().setup()
        self._lock = threading.Lock()
        self._read_done = self._expired = False
        self._timer = threading.Timer(self.server.limits.read_timeout_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._read_done:
                return
            self._expired = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _finish_reading(self) -> bool:
        """Disarms the deadline; whether the request arrived in time."""
        self._timer.cancel()
        with self._lock:
            self._read_done = True
            return not self._expired

    def finish(self) -> None:
        """Disarms the deadline and closes the connection."""
        self._timer.cancel()
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        """Everything but `POST /run_code` is a 404."""
        if self._finish_reading():
            self._refuse(404, "POST /run_code")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        """Authenticates, reads and checks the request, waits for a worker, runs it."""
        limits = self.server.limits
        if self.path.rstrip("/") != "/run_code":
            return self.do_GET()
        if not self._authorized():
            if self._finish_reading():
                self._refuse(401, "a bearer token is required (the token `peerflow sandbox "
                             "serve` printed or was given; sandbox.token_env on the client)")
            return None
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            length = -1
        if length < 0 or length > limits.max_body_bytes:
            if self._finish_reading():
                self._refuse(*((411, "a Content-Length is required") if length < 0 else
                               (413, f"the body is {length} bytes; at most "
                                     f"{limits.max_body_bytes} are accepted")))
            return None
        body = b""
        with contextlib.suppress(OSError):
            body = self.rfile.read(length)
        if not self._finish_reading() or len(body) != length:
            self.close_connection = True
            return None
        try:
            code, stdin, run_limits = parse_request(json.loads(body), limits.cap)
        except BadRequestError as exc:
            return self._send(400, _error(str(exc)))
        except (ValueError, RecursionError) as exc:
            return self._send(400, _error(f"the body is not JSON ({type(exc).__name__}: "
                                          f"{exc})"[:500]))
        return self._run(code, stdin, run_limits)

    def _run(self, code: str, stdin: str, limits: SandboxLimits) -> None:
        if not self.server.workers.acquire(timeout=self.server.limits.queue_s):
            self._send(503, _error(f"all {self.server.limits.workers} workers are busy; "
                                   "retry later"), retry_after=True)
            return
        answer, reply = 200, {}
        try:
            reply = run_request(self.server.sandbox, code, stdin, limits)
        except Exception as exc:  # noqa: BLE001 - one program must not end the service
            answer, reply = 500, _error(f"the sandbox failed: {type(exc).__name__}: {exc}")
        finally:
            self.server.workers.release()
        self._send(answer, reply)

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        # http.client decodes header bytes as latin-1; surrogateescape takes any str back.
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                   f"Bearer {self.server.token}".encode())

    def _refuse(self, code: int, message: str) -> None:
        """Answers before the body was read, then drains it so the answer is not reset."""
        self._send(code, _error(message))
        linger(self.connection)

    def _send(self, code: int, body: dict[str, Any], retry_after: bool = False) -> None:
        data = json.dumps(body).encode()
        with contextlib.suppress(OSError):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if retry_after:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """Silent: one line per program would flood the terminal."""
        del format, args


def address_family(host: str) -> socket.AddressFamily:
    """The family `host` binds with (`::1` and other IPv6 names: `AF_INET6`).

    Raises:
        OSError: `host` does not resolve, naming it.
    """
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"{host!r} does not resolve to an address to bind: {exc}"
                      ) from exc
    return infos[0][0]


class SandboxServer(ThreadingHTTPServer):
    """The `run_code` service (`make_server` builds one; `serve_forever` runs it)."""

    block_on_close = False
    #: The listen backlog (socketserver's 5 reset a burst of 24 connections).
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], sandbox: Sandbox, token: str,
                 limits: ServeLimits) -> None:
        """Binds `address` (host, port) in the host's address family."""
        self.address_family = address_family(address[0])
        self.sandbox, self.token, self.limits = sandbox, token, limits
        self.workers = threading.BoundedSemaphore(limits.workers)
        self.connections = threading.BoundedSemaphore(limits.max_connections)
        self.refusals = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(address, RunCodeHandler)

    def server_bind(self) -> None:
        """Binds without the reverse DNS lookup `HTTPServer` does for its name."""
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    @property
    def url(self) -> str:
        """The base URL clients use (`sandbox.url`)."""
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread per connection, up to `max_connections`; past them a 503.

        The 503s are written by threads of their own, as many again at most; a connection
        past both is closed at once.
        """
        if not self.connections.acquire(blocking=False):
            if not self.refusals.acquire(blocking=False):
                self.shutdown_request(request)
                return
            threading.Thread(target=self._refuse_busy, args=(request,), daemon=True,
                             name="peerflow-sandbox-busy").start()
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connections.release()
            raise

    def _refuse_busy(self, request: Any) -> None:
        try:
            _busy(request, self.limits.max_connections)
            self.shutdown_request(request)
        finally:
            self.refusals.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serves one connection and frees its place."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Silent: a client that hung up is not the service's failure."""
        del request, client_address


def linger(sock: socket.socket, seconds: float = 1.0) -> None:
    """Ends the answer and reads what the client still sends (`DRAIN_BYTES`, `seconds`).

    Closing a socket with unread bytes sends a reset, which can reach the client before it
    reads the answer; so an early refusal reads on until the client hangs up.
    """
    deadline = time.monotonic() + seconds
    drained = 0
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        while drained < DRAIN_BYTES and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                break
            drained += len(chunk)


def _busy(sock: socket.socket, limit: int) -> None:
    """A 503 for a connection past `max_connections` (at most a second of its time)."""
    body = json.dumps(_error(f"{limit} connections are open; retry later")).encode()
    head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Retry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with contextlib.suppress(OSError):
        sock.settimeout(1.0)
        sock.sendall(head + body)
        linger(sock)


def make_server(sandbox: Sandbox, host: str = "127.0.0.1", port: int = 0,
                token: str | None = None, limits: ServeLimits | None = None,
                ) -> SandboxServer:
    """A `run_code` service answering from `sandbox` (call `serve_forever`).

    Args:
        sandbox: Runs each program.
        host: The address to bind (IPv4 or IPv6).
        port: The port (0: a free one; `server.url` says which).
        token: The bearer token every request must carry; `None` or empty: a fresh one
            from `secrets` (`server.token`).
        limits: What the service accepts (default `ServeLimits()`).
    """
    return SandboxServer((host, port), sandbox, token or secrets.token_urlsafe(32),
                         limits or ServeLimits())


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    """Serves in a daemon thread (tests and benchmarks); `server.shutdown()` stops it."""
    thread = threading.Thread(target=server.serve_forever, daemon=True,
                              name="peerflow-sandbox-server")
    thread.start()
    return thread
