"""OpenEnv environments served by the run, and TRL-style `environment_factory` classes.

Both run through the real multi-turn driver on the hf engine (tiny random chat model with
a tool-calling template). A random model writes no tool calls, so the test environments
replace the model's first turns with fixed ones (a `multiply` call, then the answer);
everything else is real: the OpenEnv server on loopback (`create_app`, WebSocket
sessions, MCP tools through fastmcp), the tool loop, the rendering, the rewards.
"""

from __future__ import annotations

import attrs
import pytest

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents.rollout import ENV_REWARD_COMPONENTS, LOSS_MASK, AgentRollout
from peerflow.algorithms.base import Example
from peerflow.config import AgentConfig, structure_options
from peerflow.engines import EngineContext
from peerflow.errors import ConfigError
from peerflow.rollout.sampler import Draw

pytest.importorskip("openenv")
pytest.importorskip("fastmcp")

from peerflow.contrib.ecosystem.openenv import OpenEnvEnvironment, OpenEnvOptions  # noqa: E402
from peerflow.contrib.ecosystem.tool_episodes import (  # noqa: E402
    EnvironmentFactory,
    FactoryOptions,
)

SERVER = "tests.helpers.openenv_envs:MultiplyEnv"
FACTORY = "tests.helpers.openenv_envs:MultiplyGame"
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


def _scripted(cls):
    """`cls` whose first turn is a `multiply` call and, for answer "42", second turn "42"."""

    class Scripted(cls):
        name = f"scripted-{cls.name}"

        def step(self, turn):
            script = [CALL, "42"] if self.example.answer == "42" else [CALL]
            if turn.index < len(script):
                turn = attrs.evolve(turn, text=script[turn.index])
            return super().step(turn)

    return Scripted


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from tests.helpers.chat_model import build_chat_model

    path = build_chat_model(tmp_path_factory.mktemp("chat"))
    return HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout(), seed=1))


@pytest.mark.parametrize("cls,options", [
    (OpenEnvEnvironment, OpenEnvOptions(server=SERVER, answer_tool="submit",
                                        max_concurrent_envs=8)),
    (EnvironmentFactory, FactoryOptions(factory=FACTORY, answer_tool="submit")),
], ids=["openenv-served", "environment-factory"])
def test_a_tool_game_runs_multi_turn_through_the_driver(engine, cls, options):
    tok = engine.tokenizer
    driver = AgentRollout(env_cls=_scripted(cls), env_options=options,
                          settings=AgentConfig(environment=cls.name, max_turns=6,
                                               max_total_tokens=1500))
    draws = [Draw(position=i, example=Example(prompt="What is 6 times 7?", answer=a, index=i))
             for i, a in enumerate(["42", "41"])]
    batch = driver(engine, tok, draws, SamplingParams(n=2, temperature=1.0, max_tokens=6,
                                                       seed=2))
    name = options.reward_name or "get_reward"
    # "42": multiply, then the right answer (reward 1); "41": multiply, then three wrong
    # answers through the submit tool, each answered, until the game ends (reward 0).
    assert batch["num_turns"].tolist() == [2, 2, 4, 4]
    assert batch["env_reward"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert batch[ENV_REWARD_COMPONENTS] == [{name: 1.0}] * 2 + [{name: 0.0}] * 2
    assert list(batch["finish_reason"]) == ["stop"] * 4
    prompt = tok.decode(batch.ragged("prompt_ids").rows()[0].tolist())
    assert '"name": "multiply"' in prompt and '"name": "submit"' in prompt  # tools offered
    assert ("helper" in prompt) is False
    for ids, mask, logprobs in zip(batch.ragged("response_ids").rows(),
                                   batch.ragged(LOSS_MASK).rows(),
                                   batch.ragged("rollout_logprobs").rows()):
        observed = tok.decode(ids[~mask].tolist())
        assert "<tool_response>\n42\n</tool_response>" in observed  # the result, masked
        assert logprobs[~mask].abs().sum() == 0 and (logprobs[mask] < 0).all()
    wrong = tok.decode(batch.ragged("response_ids").rows()[2][
        ~batch.ragged(LOSS_MASK).rows()[2]].tolist())
    assert "wrong, 2 tries left" in wrong and "wrong, 1 tries left" in wrong


@pytest.fixture(scope="module")
def own_server():
    """An OpenEnv server the test starts itself (what `options.url` reaches)."""
    import threading
    import time

    import uvicorn
    from openenv.core.env_server import create_app

    from tests.helpers.openenv_envs import EchoAction, EchoEnv, EchoObservation

    app = create_app(EchoEnv, EchoAction, EchoObservation, env_name="echo",
                     max_concurrent_envs=4)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def test_a_running_server_is_reached_at_its_url_with_text_actions(own_server):
    from peerflow.agents.environment import Turn

    options = OpenEnvOptions(url=own_server, action_field="message",
                             observation_field="echoed")
    env = OpenEnvEnvironment(Example(prompt="Say stop.", answer="", index=0), options)
    try:
        assert env.tool_schemas() == []
        assert env.initial_prompt() == [{"role": "user", "content": "Say stop."},
                                        {"role": "user", "content": "ready: Say stop."}]
        result = env.step(Turn(token_ids=[1], text="hello"))
        assert result.observation == "HELLO" and not result.done
        assert env.step(Turn(token_ids=[2], text="stop", index=1)).done
        assert env.final_reward() == {"openenv": 1.25}  # the observations' rewards, summed
    finally:
        env.close()


def test_options_are_checked(plugin_manager):
    with pytest.raises(ConfigError, match="exactly one of rollout.agent.options.server"):
        structure_options(OpenEnvOptions, {}, "rollout.agent.options")
    with pytest.raises(ConfigError, match="openenv_envs' defines no function 'Nope'"):
        structure_options(OpenEnvOptions, {"server": "tests.helpers.openenv_envs:Nope"},
                          "rollout.agent.options")
    assert set(plugin_manager.registry("environment").names()) >= {
        "openenv", "environment-factory", "verifiers"}


def test_the_runs_own_server_refuses_callers_without_the_runs_token():
    """Another local process reaching the run's OpenEnv server gets no session or tool."""
    import httpx
    from openenv.core import GenericEnvClient

    from peerflow.agents.endpoint.serving import run_token
    from peerflow.contrib.ecosystem.openenv import served_url, session_client

    options = OpenEnvOptions(server=SERVER, answer_tool="submit", max_concurrent_envs=8)
    url = served_url(options)  # the server a run's episodes start
    call = {"action": {"type": "call_tool", "tool_name": "multiply",
                       "arguments": {"a": 6, "b": 7}}}
    for path, body in (("/reset", {}), ("/step", call), ("/mcp", {"jsonrpc": "2.0", "id": 1,
                                                                    "method": "tools/list"})):
        refused = httpx.post(f"{url}{path}", json=body)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/health", headers={"Authorization": "Bearer nope"}
                     ).status_code == 401
    stranger = GenericEnvClient(base_url=url, connect_timeout_s=5).sync()
    with pytest.raises(ConnectionError, match="403"):  # the WebSocket handshake is refused
        stranger.connect()
    assert httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {run_token()}"}
                     ).status_code == 200
    own = session_client(url, run_token(), 5)
    try:
        own.connect()
        listed = own.step({"type": "list_tools"}).observation.get("tools") or []
        assert "multiply" in {t["name"] for t in listed}
    finally:
        own.close()
