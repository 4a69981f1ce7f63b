"""OpenEnv environments (`rollout.agent.environment: openenv`), served by the run or reached.

An OpenEnv environment is a server (`openenv.core.env_server.Environment`: `reset`, `step`,
`state`) that clients drive over a WebSocket, one session per client. Either the run
serves it: `options.server: my_pkg.env:CalcEnv` names the `Environment` subclass, and
each rollout process starts one server on 127.0.0.1 (a free port) the first time an
episode needs it, with `create_app(..., max_concurrent_envs=options.max_concurrent_envs)`
(OpenEnv accepts one session unless that is raised; keep it at least
`rollout.agent.concurrency`); or `options.url` reaches one already running.

A server the run starts asks for the run's bearer token (`serving.run_token`, the policy
endpoint's) on every HTTP request and WebSocket handshake: another local process cannot
open sessions or call its tools (401, or the handshake closed with 1008). It has the
endpoint's connection limits (`peerflow.agents.endpoint.serving`). A server reached at
`options.url` is the user's: no token is sent to it.

Each trajectory opens its own session (`GenericEnvClient(...).sync()`), resets it with the
example's fields (`prompt`, `answer`, `index` and the dataset's columns; the server keeps
those its `reset` takes), lists the environment's MCP tools (`list_tools`; an
`MCPEnvironment`'s `@mcp.tool` functions) for the prompt, and then runs the tool loop of
`peerflow.contrib.ecosystem.tool_episodes`: each `<tool_call>` is a `call_tool` action,
its result the `tool` message the model sees. A non-MCP environment takes the model's
text as its action instead: `options.action_field: message` sends each turn as
`{"message": text}` and shows the observation's `observation_field` (or the observation
as JSON). The observations' `reward`s are summed into the reward component `reward_name`
(`openenv`); an observation with `done` ends the episode.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import Any, ClassVar

import attrs

from peerflow.agents.environment import StepResult, Turn
from peerflow.algorithms.base import Example
from peerflow.contrib.ecosystem.tool_episodes import (
    ToolAnswer,
    ToolEpisode,
    ToolEpisodeOptions,
    load_target,
)

MODULES = ("openenv", "fastmcp")
EXTRA = "openenv"
INSTALL_HINT = ("pip install 'peerflow[openenv]' && pip install --no-deps openenv-core==0.3.0 "
                "(scripts/install-cpu.sh does both; docs/environments.md says why)")


def _loadable(_: object, attribute: attrs.Attribute, value: str) -> None:
    import importlib.util

    if value and all(importlib.util.find_spec(m) for m in MODULES):  # else: the extra named
        load_target(value, f"rollout.agent.options.{attribute.name}")


@attrs.frozen(kw_only=True)
class OpenEnvOptions(ToolEpisodeOptions):
    """`rollout.agent.options` of `openenv`."""

    server: str = attrs.field(default="", validator=_loadable)
    """The `Environment` subclass the run serves on 127.0.0.1 (`module:Cls`, `file.py:Cls`)."""
    action: str = attrs.field(default="", validator=_loadable)
    """Its action class (default: OpenEnv's `CallToolAction`, for MCP environments)."""
    observation: str = attrs.field(default="", validator=_loadable)
    """Its observation class (default: OpenEnv's `CallToolObservation`)."""
    max_concurrent_envs: int = attrs.field(default=64, validator=attrs.validators.gt(0))
    """Sessions the served environment accepts at once (per rollout process)."""
    url: str = ""
    """A running OpenEnv server to use instead of `server` (`http://host:port`)."""
    action_field: str = ""
    """For a non-tool environment: the action field each turn's text is sent as."""
    observation_field: str = ""
    """The observation field shown to the model after a text action (default: all, JSON)."""
    connect_timeout_s: float = 30.0
    """Seconds to wait for a session (the server's start included)."""
    reward_name: str = "openenv"
    """The reward component the observations' rewards are summed into."""

    def __attrs_post_init__(self) -> None:
        if bool(self.server) == bool(self.url):
            raise ValueError("rollout.agent.environment: openenv needs exactly one of "
                             "rollout.agent.options.server (an OpenEnv Environment class the "
                             "run serves, module:Cls) and rollout.agent.options.url (a running "
                             "server).")


class _Servers:
    """The OpenEnv servers this process started, one per (class, settings), on loopback."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._urls: dict[tuple[str, str, str, int], str] = {}

    def url(self, options: OpenEnvOptions) -> str:
        """The server of `options.server`, started on its first use."""
        key = (options.server, options.action, options.observation,
               options.max_concurrent_envs)
        with self._lock:
            if key not in self._urls:
                self._urls[key] = _serve(options)
            return self._urls[key]


class _QuietClose(logging.Filter):
    """Drops the error logged when a client closed its WebSocket first.

    OpenEnv's server closes the socket again on its way out; every other error is kept.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return type(error).__name__ not in ("WebSocketDisconnect", "ClientDisconnected")


def _serve(options: OpenEnvOptions) -> str:
    from openenv.core.env_server import create_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    from peerflow.agents.endpoint.serving import ServeLimits, run_token, serve_in_thread

    key = "rollout.agent.options"
    app = create_app(
        load_target(options.server, f"{key}.server"),
        load_target(options.action, f"{key}.action") if options.action else CallToolAction,
        load_target(options.observation, f"{key}.observation") if options.observation
        else CallToolObservation,
        env_name=options.server.rsplit(":", 1)[-1],
        max_concurrent_envs=options.max_concurrent_envs)
    logging.getLogger("uvicorn.error").addFilter(_QuietClose())
    limits = ServeLimits(max_connections=max(64, 4 * options.max_concurrent_envs))
    try:
        _, _, port = serve_in_thread(app, "127.0.0.1", 0, run_token(), name="openenv",
                                     limits=limits, timeout_s=options.connect_timeout_s,
                                     ws_ping_interval=None)
    except RuntimeError as exc:
        raise RuntimeError(f"the OpenEnv server of {options.server!r} did not start: "
                           f"{exc}") from exc
    return f"http://127.0.0.1:{port}"


@functools.lru_cache(maxsize=1)
def _client_class() -> type:
    """OpenEnv's generic client, sending a bearer token on its WebSocket handshake."""
    from openenv.core import GenericEnvClient

    class BearerEnvClient(GenericEnvClient):
        """`GenericEnvClient` with `Authorization: Bearer <token>` (openenv-core 0.3)."""

        def __init__(self, *args: Any, token: str, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._peerflow_headers = {"Authorization": f"Bearer {token}"}

        async def connect(self) -> Any:
            """Opens the session's WebSocket (on loopback: never through a proxy)."""
            from websockets.asyncio.client import connect

            if self._ws is None:
                try:
                    self._ws = await connect(
                        self._ws_url, open_timeout=self._connect_timeout,
                        max_size=self._max_message_size, proxy=None,
                        additional_headers=self._peerflow_headers)
                except Exception as exc:
                    raise ConnectionError(f"Failed to connect to {self._ws_url}: {exc}"
                                          ) from exc
            return self

    return BearerEnvClient


def session_client(url: str, token: str | None, connect_timeout_s: float) -> Any:
    """A synchronous OpenEnv client of `url` (with the run's `token` for its own server)."""
    from openenv.core import GenericEnvClient

    if token is None:
        return GenericEnvClient(base_url=url, connect_timeout_s=connect_timeout_s).sync()
    return _client_class()(base_url=url, connect_timeout_s=connect_timeout_s,
                           token=token).sync()


_SERVERS = _Servers()


def served_url(options: OpenEnvOptions) -> str:
    """The URL of this process's server of `options.server`, started on first use."""
    return _SERVERS.url(options)


def _text(result: Any) -> str:
    """The text of an MCP tool result as OpenEnv serialises it (content parts, or data)."""
    if isinstance(result, dict):
        parts = [p.get("text", "") for p in result.get("content") or []
                 if isinstance(p, dict) and p.get("type") == "text"]
        if parts:
            return "\n".join(parts)
        if "data" in result:
            result = result["data"]
    return result if isinstance(result, str) else json.dumps(result)


class OpenEnvEnvironment(ToolEpisode):
    """One session of an OpenEnv environment; tool calls are `call_tool` actions."""

    name: ClassVar[str] = "openenv"
    options_class: ClassVar[type] = OpenEnvOptions
    requires: ClassVar[tuple[str, ...]] = MODULES
    extra: ClassVar[str] = EXTRA
    install_hint: ClassVar[str] = INSTALL_HINT

    def __init__(self, example: Example, options: OpenEnvOptions) -> None:
        super().__init__(example, options)
        from peerflow.agents.endpoint.serving import run_token
        from peerflow.rewards.scoring import example_record

        url = options.url or served_url(options)
        self.client = session_client(url, None if options.url else run_token(),
                                     options.connect_timeout_s)
        self.schemas: list[dict[str, Any]] = []
        try:
            self._start(example_record(example))
        except BaseException:
            self.client.close()  # the driver never closes an episode it could not create
            raise

    def _start(self, record: dict[str, Any]) -> None:
        """Connects, resets with the example's plain fields and lists the tools."""
        self.client.connect()
        first = self.client.reset(**{k: v for k, v in record.items() if isinstance(
            v, (str, int, float, bool, list, dict, type(None)))})
        self._observe(first)
        self.opening = self._shown(first.observation) if self.options.action_field else ""
        if not self.options.action_field:
            listed = self.client.step({"type": "list_tools"}).observation.get("tools") or []
            self.schemas = [{"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema") or t.get("inputSchema") or {
                    "type": "object", "properties": {}}}} for t in listed]

    def _observe(self, result: Any) -> None:
        if result.reward is not None:
            self.rewards.append(float(result.reward))

    def _shown(self, observation: dict[str, Any]) -> str:
        field = self.options.observation_field
        if field:
            value = observation.get(field, "")
            return value if isinstance(value, str) else json.dumps(value)
        return json.dumps({k: v for k, v in observation.items()
                           if k not in ("reward", "done", "metadata")})

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The environment's MCP tools (empty for a text-action environment)."""
        return self.schemas

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolAnswer:
        """One `call_tool` action; its observation's result, reward and `done`."""
        result = self.client.step({"type": "call_tool", "tool_name": name,
                                   "arguments": arguments})
        observation = result.observation or {}
        error = observation.get("error")
        outcome = observation.get("result")
        failed = bool(error) or (isinstance(outcome, dict) and bool(outcome.get("is_error")))
        text = (error.get("message", str(error)) if isinstance(error, dict) else str(error)) \
            if error else _text(outcome)
        return ToolAnswer(text=text, reward=result.reward, done=bool(result.done),
                          error=failed)

    def step(self, turn: Turn) -> StepResult:
        """A tool episode's step, or the turn's text as the action (`action_field`)."""
        if not self.options.action_field:
            return super().step(turn)
        result = self.client.step({self.options.action_field: turn.text})
        self._observe(result)
        if result.done:
            return StepResult(done=True)
        return StepResult(observation=self._shown(result.observation or {}))

    def close(self) -> None:
        """Ends the session (the server keeps running for the next episodes)."""
        self.client.close()
