"""The HTTP service: FastAPI routes under uvicorn, on a thread of the rollout process.

Imported only by an `agent-program` episode (FastAPI and uvicorn: `peerflow[endpoint]`).

One server per process that runs agent episodes (each rollout rank its own, on a free
loopback port by default). An episode is reached under its own base URL,
`http://HOST:PORT/episodes/<id>/v1`, so every call an agent program makes lands in the
episode's inbox, where the agent driver picks it up (`peerflow.agents.endpoint.program`):
the endpoint never calls an engine itself.

Security: bound to 127.0.0.1 by default; every route needs `Authorization: Bearer
<token>` (the run's token: random per process, or read from `token_env`); a missing or
wrong token is answered 401. A non-loopback host without a token is refused when the
config is validated (`AgentProgramOptions`).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import threading
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from peerflow.agents.endpoint.protocol import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
    to_call,
)

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
    episodes: dict[str, Any] = attrs.field(factory=dict)
    _server: Any = None
    _thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Starts uvicorn on a daemon thread and waits until it listens."""
        import uvicorn

        config = uvicorn.Config(build_app(self), host=self.host, port=self.port,
                                log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="peerflow-endpoint",
                                        daemon=True)
        self._thread.start()
        deadline = threading.Event()
        for _ in range(int(timeout_s * 20)):
            if self._server.started:
                break
            if not self._thread.is_alive():
                raise RuntimeError(f"the policy endpoint could not listen on "
                                   f"{self.host}:{self.port}; choose another "
                                   "rollout.agent.options.port (0 picks a free one).")
            deadline.wait(0.05)
        else:
            raise RuntimeError(f"the policy endpoint did not start within {timeout_s} s.")
        sockets = [s for server in self._server.servers for s in server.sockets]
        self.port = int(sockets[0].getsockname()[1])

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

    def authorised(self, header: str | None) -> bool:
        """Whether an `Authorization` header carries the token."""
        if self.token is None:
            return True
        expected = f"Bearer {self.token}"
        return header is not None and hmac.compare_digest(header.encode(), expected.encode())


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


def new_token() -> str:
    """A random bearer token (a run's own, when no `token_env` names one)."""
    return secrets.token_urlsafe(32)


def build_app(endpoint: PolicyEndpoint) -> Any:
    """The FastAPI application: models, chat, completions and vLLM's token-in generate."""
    app = FastAPI(title="PeerFlow policy endpoint", docs_url=None, redoc_url=None,
                  openapi_url=None)

    def refuse(status: int, message: str, kind: str = "invalid_request_error") -> Any:
        return JSONResponse(error_body(message, kind), status_code=status)

    @app.middleware("http")
    async def bearer(request: Request, call_next: Any) -> Any:
        if not endpoint.authorised(request.headers.get("authorization")):
            return refuse(401, "missing or wrong bearer token: pass the api_key PeerFlow "
                          "gave the episode (Authorization: Bearer …).", "authentication_error")
        return await call_next(request)

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model",
                                            "created": 0, "owned_by": "peerflow"}]}

    app.get("/v1/models")(models)
    app.get("/episodes/{episode_id}/v1/models")(models)

    async def serve(kind: str, episode_id: str, raw: dict[str, Any]) -> Any:
        schema = {"chat": ChatRequest, "completion": CompletionRequest,
                  "generate": GenerateRequest}[kind]
        try:
            call = to_call(kind, schema.model_validate(raw))
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            return refuse(400, str(exc))
        with _LOCK:
            episode = endpoint.episodes.get(episode_id)
        if episode is None:
            return refuse(404, f"no open episode {episode_id!r} on this endpoint: use the "
                          "base_url PeerFlow gave the episode, while it runs.")
        status, body = await asyncio.wrap_future(episode.submit(call))
        return body if status == 200 else JSONResponse(body, status_code=status)

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    @app.post("/inference/v1/generate")
    async def outside_an_episode() -> Any:
        return refuse(404, "calls are recorded per episode: use the base_url PeerFlow gave "
                      "the episode (http://HOST:PORT/episodes/<id>/v1).")

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def chat(episode_id: str, request: Request) -> Any:
        return await serve("chat", episode_id, await request.json())

    @app.post("/episodes/{episode_id}/v1/completions")
    async def completions(episode_id: str, request: Request) -> Any:
        return await serve("completion", episode_id, await request.json())

    @app.post("/episodes/{episode_id}/inference/v1/generate")
    async def generate(episode_id: str, request: Request) -> Any:
        return await serve("generate", episode_id, await request.json())

    return app
