"""The HTTP service: FastAPI routes under uvicorn, on a thread of the rollout process.

Imported only by an `agent-program` episode (FastAPI and uvicorn: `peerflow[endpoint]`).

One server per process that runs agent episodes (each rollout rank its own, on a free
loopback port by default). An episode is reached under its own base URL,
`http://HOST:PORT/episodes/<id>/v1`, so every call an agent program makes lands in the
episode's inbox, where the agent driver picks it up (`peerflow.agents.endpoint.program`):
the endpoint never calls an engine itself.

Session affinity: an episode lives on the rollout process whose driver runs it, and its
calls are routed by its id — in the route (`/episodes/<id>/v1/...`), or, for clients that
keep one base URL, in an `X-Session-Id` header or a `session_id` body field on the plain
`/v1/...` routes (`route_episode`). So every call of a trajectory reaches the one engine
replica that generated its earlier turns, with the whole sequence as its prompt: vLLM's
prefix cache reuses their KV blocks.

Security: bound to 127.0.0.1 by default; every route needs `Authorization: Bearer
<token>` (the run's token: random per process, or read from `token_env`); a missing or
wrong token is answered 401. A non-loopback host without a token is refused when the
config is validated (`AgentProgramOptions`). Every body is validated at the edge against
the model's and the run's limits (`protocol`, `limits`): a malformed call is answered 400
naming the field (OpenAI's `error.param`) and never reaches the engine. Connection limits
(a read deadline, header and body sizes, a connection cap) are `serving.ServeLimits`.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from peerflow.agents.endpoint.limits import RequestLimits
from peerflow.agents.endpoint.protocol import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
    refused_field,
    to_call,
)
from peerflow.agents.endpoint.sampling import FieldError
from peerflow.agents.endpoint.serving import ServeLimits, serve_in_thread

_LOCK = threading.Lock()
_SERVERS: dict[tuple[str, int, str], PolicyEndpoint] = {}


@attrs.define(eq=False)
class PolicyEndpoint:
    """An OpenAI-compatible service in front of this process's agent episodes."""

    host: str
    port: int
    token: str | None
    """Bearer token every request must carry; `None` only when auth was switched off."""
    model_name: str = "policy"
    limits: ServeLimits = ServeLimits()
    """Connection limits: read deadline, header and body sizes, connection cap."""
    episodes: dict[str, Any] = attrs.field(factory=dict)
    _server: Any = None
    _thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Starts uvicorn on a daemon thread and waits until it listens."""
        try:
            self._server, self._thread, self.port = serve_in_thread(
                build_app(self), self.host, self.port, self.token, name="peerflow-endpoint",
                limits=self.limits, timeout_s=timeout_s, lifespan="off")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc} Choose another rollout.agent.options.port (0 picks a "
                               "free one).") from exc

    def stop(self) -> None:
        """Asks uvicorn to exit and waits for its thread."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def base_url(self, episode_id: str) -> str:
        """The OpenAI `base_url` of one episode."""
        return f"http://{self.host}:{self.port}/episodes/{episode_id}/v1"

    def add(self, episode_id: str, episode: Any) -> None:
        """Routes calls under `episode_id` to `episode` (its `submit(call)`)."""
        with _LOCK:
            self.episodes[episode_id] = episode

    def remove(self, episode_id: str) -> None:
        """Stops routing calls to an episode (later calls get 404)."""
        with _LOCK:
            self.episodes.pop(episode_id, None)


def endpoint_for(host: str, port: int, token: str | None, model_name: str) -> PolicyEndpoint:
    """This process's endpoint with these settings, started on first use."""
    key = (host, port, token or "")
    with _LOCK:
        endpoint = _SERVERS.get(key)
        if endpoint is None:
            endpoint = PolicyEndpoint(host=host, port=port, token=token, model_name=model_name)
            _SERVERS[key] = endpoint
            endpoint.start()
        return endpoint


#: The header that names an episode on the plain `/v1/...` routes (session affinity).
SESSION_HEADER = "x-session-id"


def route_episode(route_id: str | None, header: str | None, body: dict[str, Any]
                  ) -> tuple[str | None, str]:
    """The episode a call belongs to: from its route, its `X-Session-Id`, or `session_id`.

    Returns:
        The episode id (`None` when the call names none), and why the call is refused
        (empty when it is not): ids that disagree, or no id at all.
    """
    session = body.get("session_id")
    if session is not None and not isinstance(session, str):
        return None, f"session_id={session!r}: must be a string (the episode's id)."
    named = {v for v in (route_id, header, session) if v}
    if len(named) > 1:
        return None, (f"the call names episodes {sorted(named)} (route, X-Session-Id header, "
                      "session_id field): name one, the episode whose calls these are.")
    if not named:
        return None, ("calls are recorded per episode: use the base_url PeerFlow gave the "
                      "episode (http://HOST:PORT/episodes/<id>/v1), or name the episode in "
                      "an X-Session-Id header.")
    return named.pop(), ""


#: A JSON escape of a UTF-16 surrogate (`\\ud800`-`\\udfff`): the only way a body's
#: JSON makes a `str` that is no text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def unencodable(value: Any, path: str = "") -> str | None:
    """The first field of a JSON value holding a lone UTF-16 surrogate, or `None`.

    `json.loads` turns the escape `ud800` into a `str` no tokenizer can encode (a 400 that ended
    the episode when the prompt was rendered); refused at the edge, naming the field.
    """
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(item, dict):
            stack += [(f"{where}.{k}" if where else str(k), k) for k in item]
            stack += [(f"{where}.{k}" if where else str(k), v) for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(f"{where}.{i}" if where else str(i), v) for i, v in enumerate(item)]
    return None


def _sse(events: list[dict[str, Any]]) -> Any:
    """Server-sent events: each chunk, then `[DONE]`."""
    import json

    def lines() -> Any:
        for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def build_app(endpoint: PolicyEndpoint) -> Any:
    """The FastAPI application: models, chat, completions and vLLM's token-in generate."""
    app = FastAPI(title="PeerFlow policy endpoint", docs_url=None, redoc_url=None,
                  openapi_url=None)

    def refuse(status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None) -> Any:
        return JSONResponse(error_body(message, kind, param), status_code=status)

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model",
                                            "created": 0, "owned_by": "peerflow"}]}

    app.get("/v1/models")(models)
    app.get("/episodes/{episode_id}/v1/models")(models)

    async def serve(kind: str, route_id: str | None, request: Request) -> Any:
        schema = {"chat": ChatRequest, "completion": CompletionRequest,
                  "generate": GenerateRequest}[kind]
        try:
            raw = await request.json()
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep
            return refuse(400, f"the request body is not JSON: {exc}")
        if not isinstance(raw, dict):
            return refuse(400, "the request body must be a JSON object.")
        escaped = _SURROGATE_ESCAPE.search(await request.body())  # else no walk
        bad = unencodable(raw) if escaped else None
        if bad is not None:
            return refuse(400, f"{bad}: holds a lone UTF-16 surrogate (a \\ud800-\\udfff "
                          "escape outside a pair), which is no text; send valid UTF-8.",
                          param=bad)
        episode_id, problem = route_episode(route_id, request.headers.get(SESSION_HEADER), raw)
        if problem:
            typed = isinstance(raw.get("session_id"), str | None)
            return refuse(404 if typed and route_id is None and episode_id is None else 400,
                          problem, param=None if typed else "session_id")
        with _LOCK:
            episode = endpoint.episodes.get(episode_id)
        limits = getattr(episode, "limits", None) or RequestLimits()
        try:
            call = to_call(kind, schema.model_validate(raw, context=limits))
        except ValidationError as exc:
            param, message = refused_field(exc)
            return refuse(400, message, param=param)
        except FieldError as exc:
            return refuse(400, str(exc), param=exc.param)
        if episode is None:
            return refuse(404, f"no open episode {episode_id!r} on this endpoint: use the "
                          "base_url PeerFlow gave the episode, while it runs.")
        status, body = await asyncio.wrap_future(episode.submit(call))
        if status == 200 and isinstance(body, list):
            return _sse(body)
        return body if status == 200 else JSONResponse(body, status_code=status)

    routes = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
              "generate": "/inference/v1/generate"}
    def plain(kind: str) -> Any:
        async def route(request: Request) -> Any:
            return await serve(kind, None, request)
        return route

    def scoped(kind: str) -> Any:
        async def route(episode_id: str, request: Request) -> Any:
            return await serve(kind, episode_id, request)
        return route

    for kind, path in routes.items():
        app.post(path)(plain(kind))
        app.post(f"/episodes/{{episode_id}}{path}")(scoped(kind))

    return app
