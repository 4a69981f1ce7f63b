"""The HTTP servers a run starts (the policy endpoint, OpenEnv), with their edge limits.

Every server a run starts on a thread of its own process goes through `serve_in_thread`:
uvicorn bound to the given host, behind `BearerGuard` (the run's bearer token on every
HTTP request and WebSocket handshake, compared as bytes in constant time; a body-size
limit), with uvicorn's connection cap (`limit_concurrency`: past it new requests get
503), its keep-alive timeout, h11's largest incomplete event (a header block past it gets
400), and a read deadline uvicorn does not have: a request must arrive whole — headers
and body — within `ServeLimits.read_timeout_s` of its first byte, or the connection is
closed (`DeadlineH11Protocol`). A run's own clients send whole requests at once, so the
deadline only ever closes a stalled or hostile connection.
"""

from __future__ import annotations

import hmac
import json
import secrets
import threading
import time
from typing import Any

import attrs
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@attrs.frozen(kw_only=True)
class ServeLimits:
    """What one server accepts from a connection."""

    read_timeout_s: float = 10.0
    """Seconds a request may take to arrive whole (headers and body), from its first byte."""
    keep_alive_s: int = 5
    """Seconds an idle keep-alive connection stays open (uvicorn's `timeout_keep_alive`)."""
    max_connections: int = 4096
    """Connections and requests at once (uvicorn's `limit_concurrency`: past it, 503);
    above the episodes one rollout process runs at once, each holding one call."""
    max_header_bytes: int = 64 * 1024
    """Largest request line and header block (h11's `max_incomplete_event_size`)."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Largest request body (413 past it)."""


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request does not arrive in time."""

    read_timeout_s: float = ServeLimits().read_timeout_s

    def connection_made(self, transport: Any) -> None:  # noqa: D102 — uvicorn's
        super().connection_made(transport)
        self._deadline: Any = None
        self._arm()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.read_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def data_received(self, data: bytes) -> None:  # noqa: D102 — uvicorn's
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # a request still arriving
            self._arm()  # (SEND_BODY unarmed: a pipelined request, read after the last)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE and self.conn.their_state is not h11.SEND_BODY:
            self._disarm()  # received whole (or closed, or switched to a WebSocket)

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: D102 — uvicorn's
        self._disarm()
        super().connection_lost(exc)

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.get_protocol() is not self or self.transport.is_closing():
            return  # upgraded to a WebSocket, or already closing
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.transport.close()


def protocol_class(limits: ServeLimits) -> type[DeadlineH11Protocol]:
    """`DeadlineH11Protocol` with `limits.read_timeout_s` (uvicorn takes a class)."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,),
                {"read_timeout_s": float(limits.read_timeout_s)})


_TOKEN_LOCK = threading.Lock()
_TOKEN: list[str] = []


def run_token() -> str:
    """This process's bearer token for the servers it starts (random, made once).

    The policy endpoint (without `token_env`) and the OpenEnv server a run starts both
    ask for it; each episode is handed it as its `api_key`.
    """
    with _TOKEN_LOCK:
        if not _TOKEN:
            _TOKEN.append(secrets.token_urlsafe(32))
        return _TOKEN[0]


def bearer_matches(header: bytes | None, token: str | None) -> bool:
    """Whether an `Authorization` header carries `Bearer <token>` (always, without a token)."""
    if token is None:
        return True
    return header is not None and hmac.compare_digest(header, f"Bearer {token}".encode())


@attrs.frozen
class BearerGuard:
    """ASGI middleware: the run's bearer token on every request, and the body-size limit."""

    app: Any
    token: str | None
    max_body_bytes: int = ServeLimits().max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Refuses a request without the token (HTTP 401, WebSocket closed 1008)."""
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        if not bearer_matches(headers.get(b"authorization"), self.token):
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _answer(send, 401, "missing or wrong bearer token: pass the api_key "
                                 "PeerFlow gave the episode (Authorization: Bearer …).",
                                 "authentication_error")
        if scope["type"] == "http":
            length = headers.get(b"content-length", b"0")
            if not length.isdigit() or int(length) > self.max_body_bytes:
                return await _answer(send, 413, f"the request body is larger than "
                                     f"{self.max_body_bytes} bytes.", "invalid_request_error")
            receive = _capped(receive, self.max_body_bytes)
        return await self.app(scope, receive, send)


def _capped(receive: Any, limit: int) -> Any:
    """`receive`, ending the request as a disconnect once the body passes `limit` bytes."""
    seen = 0

    async def capped() -> dict[str, Any]:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                return {"type": "http.disconnect"}
        return message

    return capped


async def _answer(send: Any, status: int, message: str, kind: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": None}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def serve_in_thread(app: Any, host: str, port: int, token: str | None, *, name: str,
                    limits: ServeLimits = ServeLimits(), timeout_s: float = 30.0,
                    **uvicorn_options: Any) -> tuple[Any, threading.Thread, int]:
    """Starts uvicorn serving `app` behind `BearerGuard` on a daemon thread.

    Args:
        app: The ASGI application.
        host: Address to bind.
        port: Port (0: a free one).
        token: Bearer token every request must carry (`None`: none asked).
        name: The thread's name, and the server's in errors.
        limits: Connection limits.
        timeout_s: Seconds to wait until it listens.
        uvicorn_options: More `uvicorn.Config` settings (`ws_ping_interval`, …).

    Returns:
        The `uvicorn.Server`, its thread, and the port it listens on.

    Raises:
        RuntimeError: It could not listen, or did not start in time.
    """
    import uvicorn

    config = uvicorn.Config(
        BearerGuard(app, token, limits.max_body_bytes), host=host, port=port,
        log_level="error", access_log=False, http=protocol_class(limits),
        limit_concurrency=limits.max_connections, timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes, **uvicorn_options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the {name} server could not listen on {host}:{port}.")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {name} server did not start within {timeout_s} s.")
        time.sleep(0.01)
    sockets = [s for listener in server.servers for s in listener.sockets]
    return server, thread, int(sockets[0].getsockname()[1])
