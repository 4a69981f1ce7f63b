"""The policy endpoint: OpenAI-client agent programs through the one agent driver.

Real HTTP (uvicorn on loopback), the real `openai` client, the hf engine on a tiny chat
model; the trainer's batch is compared with what the endpoint answered, call by call.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents.endpoint.program import AgentProgram, AgentProgramOptions
from peerflow.agents.rollout import LOSS_MASK, AgentRollout
from peerflow.algorithms.base import Example
from peerflow.config import AgentConfig, load_config, structure_options, validate_config
from peerflow.engines import EngineContext
from peerflow.errors import ConfigError
from peerflow.rollout.sampler import Draw
from tests.unit import agent_programs
from tests.unit.test_agents_render import CHATML

pytest.importorskip("openai")
PROMPTS = ["1+2=", "ab"]


def _options(function: str, **more) -> AgentProgramOptions:
    return structure_options(AgentProgramOptions,
                             {"function": f"tests.unit.agent_programs:{function}", **more},
                             "rollout.agent.options")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    """The tiny Llama with ChatML turns and room for a tool description (2048 positions)."""
    from tests.helpers.chat_model import build_chatml_llama

    return build_chatml_llama(tmp_path_factory.mktemp("tiny-chat-long"), CHATML,
                              max_positions=2048)


@pytest.fixture(scope="module")
def tok(chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model)


@pytest.fixture(scope="module")
def engine(chat_model):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    return HFRolloutEngine(EngineContext(model_path=chat_model, layout=ParallelLayout(),
                                         seed=3))


def _run(engine, function: str, max_turns: int = 4, n: int = 2, seed: int = 7,
         max_tokens: int = 6):
    agent_programs.RECORDS.clear()
    draws = [Draw(position=i, example=Example(prompt=p, index=i))
             for i, p in enumerate(PROMPTS)]
    driver = AgentRollout(env_cls=AgentProgram, env_options=_options(function, wait_s=60),
                          settings=AgentConfig(environment="agent-program",
                                               max_turns=max_turns, max_total_tokens=400))
    return driver(engine, engine.tokenizer, draws,
                  SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed))


def _render(tok, messages):
    from peerflow.agents.tools import render_prompt

    return render_prompt(tok, messages, agent_programs.TOOLS)


def _rows(batch):
    return list(zip(batch.ragged("prompt_ids").rows(), batch.ragged("response_ids").rows(),
                    batch.ragged("rollout_logprobs").rows(), batch.ragged(LOSS_MASK).rows()))


def _matches(row, calls) -> bool:
    """Whether the trainer's sample is exactly the calls' tokens and log-probs."""
    prompt, response, logprobs, mask = row
    sequence = prompt.tolist() + response.tolist()
    sampled = [False] * len(prompt) + mask.tolist()
    lps = [0.0] * len(prompt) + logprobs.tolist()
    if calls[0]["prompt"] != prompt.tolist():
        return False
    model_positions = set()
    for call in calls:
        start, ids = len(call["prompt"]), list(call["ids"])
        if sequence[:start] != call["prompt"] or sequence[start:start + len(ids)] != ids:
            return False
        expected = torch.tensor(call["logprobs"], dtype=torch.float32)
        if not torch.equal(torch.tensor(lps[start:start + len(ids)]), expected):
            return False
        model_positions |= set(range(start, start + len(ids)))
    return model_positions == {i for i, s in enumerate(sampled) if s}


def test_chat_agent_trains_on_the_engines_own_tokens(engine, tok):
    batch = _run(engine, "chat_agent", seed=3)  # a seed whose turns include <pad> tokens
    assert len(batch) == 4 and batch["finish_reason"] == ["stop"] * 4
    assert batch["num_turns"].tolist() == [3] * 4
    records = list(agent_programs.RECORDS)
    assert len(records) == 4
    for row in _rows(batch):
        assert sum(_matches(row, calls) for calls in records) >= 1
    # Re-rendering the conversation from the messages the agent holds would not give the
    # sampled tokens (the template trims content, decoding drops special tokens), for at
    # least one turn; the endpoint never re-rendered, so the trainer still got them.
    rerendered_differs = False
    for calls in records:
        user = next(p for p in PROMPTS if _render(tok, [{"role": "user", "content": p}])
                    == calls[0]["prompt"])
        messages = [{"role": "user", "content": user}]
        for turn, call in enumerate(calls[:-1]):
            messages += [{"role": "assistant", "content": call["text"]},
                         {"role": "tool", "tool_call_id": f"t{turn}",
                          "content": str(len(call["text"] or ""))}]
            rerendered = _render(tok, messages)
            recorded = calls[turn + 1]["prompt"]
            assert recorded[:len(calls[0]["prompt"])] == calls[0]["prompt"]
            rerendered_differs |= rerendered != recorded
    assert rerendered_differs
    rewards = batch["env_reward"].tolist()
    assert sorted(rewards) == sorted(float(len(c[-1]["ids"]) % 2) for c in records)


def test_completion_and_token_in_generate_routes(engine):
    batch = _run(engine, "completion_agent")
    records = list(agent_programs.RECORDS)
    assert batch["finish_reason"] == ["stop"] * 4 and len(records) == 4
    for row in _rows(batch):
        assert sum(_matches(row, calls) for calls in records) >= 1
        # the one token the program appended itself is an observation: masked out
        prompt, response, _, mask = row
        assert 5 in response.tolist() and not all(mask.tolist())
    assert batch["env_reward"].tolist() == [1.5] * 4  # named rewards summed
    assert batch["env_reward_components"] == [{"format": 0.5, "length": 1.0}] * 4


def test_named_rewards_join_the_reward_components(engine, plugin_manager):
    from peerflow.rewards import build_reward_set
    from peerflow.worker.executors import score_texts

    batch = _run(engine, "completion_agent")
    config = load_config(None, ["task.reward=exact_match", "task.reward_limits.workers=0"])
    rewards = build_reward_set(config.task, plugin_manager, "exact_match")
    scores = score_texts(rewards, batch, ["x"] * len(batch))
    assert scores.total == [1.5] * 4  # the environment's outcome, not exact_match's 0
    assert scores.components["format"] == [0.5] * 4
    assert scores.components["length"] == [1.0] * 4
    assert scores.metrics["reward/format/mean"] == (0.5, 4)


def test_a_rewritten_turn_starts_a_new_sample_and_says_so(engine, tok):
    from peerflow.agents.rollout import SEGMENT_STRIDE

    batch = _run(engine, "rewriting_agent")
    assert len(batch) == 8  # each of the 4 episodes is two samples
    first, second = list(range(4)), list(range(4, 8))
    assert [batch["finish_reason"][i] for i in first] == ["restart"] * 4
    assert [batch["finish_reason"][i] for i in second] == ["stop"] * 4
    assert all(batch["agent_info"][i]["prefix_breaks"] == 1 for i in first)
    assert all(batch["agent_info"][i]["segment"] == 1 for i in second)
    ids = batch.sample_id.tolist()
    assert len(set(ids)) == 8 and [ids[i] - SEGMENT_STRIDE for i in second] == ids[:4]
    assert batch.group_id.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]  # same groups
    assert batch["env_reward"].tolist() == [1.0] * 8
    rows = _rows(batch)
    for calls in agent_programs.RECORDS:
        # the second call's whole prompt (re-rendered, with the rewrite) starts a sample
        # whose first turn is exactly what the endpoint answered
        assert any(p.tolist() == calls[1]["prompt"] and r.tolist() == calls[1]["ids"]
                   for p, r, _, _ in rows)
        assert any(p.tolist() == calls[0]["prompt"] and r.tolist() == calls[0]["ids"]
                   for p, r, _, _ in rows)


def test_a_driver_limit_answers_the_pending_call_503(engine):
    batch = _run(engine, "endless_agent", max_turns=2)
    assert batch["finish_reason"] == ["max_turns"] * 4
    assert batch["env_reward"].tolist() == [0.75] * 4
    assert [r[0]["status"] for r in agent_programs.RECORDS] == [503] * 4


def test_bearer_token_and_request_checks():
    from peerflow.agents.endpoint.server import endpoint_for

    endpoint = endpoint_for("127.0.0.1", 0, "secret-token", "policy")
    root = f"http://127.0.0.1:{endpoint.port}"
    assert httpx.get(f"{root}/v1/models").status_code == 401
    wrong = httpx.get(f"{root}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "bearer token" in wrong.json()["error"]["message"]
    auth = {"Authorization": "Bearer secret-token"}
    models = httpx.get(f"{root}/v1/models", headers=auth)
    assert models.json()["data"][0]["id"] == "policy"
    outside = httpx.post(f"{root}/v1/chat/completions", json={}, headers=auth)
    assert outside.status_code == 404 and "per episode" in outside.json()["error"]["message"]
    url = f"{root}/episodes/none/v1/chat/completions"
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(url, json=body, headers=auth).status_code == 404
    for bad, text in (({"n": 2}, "n must be 1"), ({"stream": True}, "stream")):
        answer = httpx.post(url, json={**body, **bad}, headers=auth)
        assert answer.status_code == 400 and text in answer.json()["error"]["message"]


def test_non_loopback_without_a_token_is_refused_at_validate(plugin_manager):
    with pytest.raises(ConfigError, match="token_env"):
        _options("chat_agent", host="0.0.0.0")
    config = load_config(None, [
        "rollout.agent.environment=agent-program",
        "rollout.agent.options.function=tests.unit.agent_programs:chat_agent",
        "rollout.agent.options.host=0.0.0.0"])
    with pytest.raises(ConfigError, match="set rollout.agent.options.token_env"):
        validate_config(config, plugin_manager)
    with pytest.raises(ConfigError, match="is not set"):
        _options("chat_agent", host="0.0.0.0", token_env="PEERFLOW_TEST_UNSET_TOKEN")


def test_missing_server_libraries_name_the_extra(monkeypatch, plugin_manager):
    import importlib.util

    from peerflow.config.extras import dependency_problems

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: (
        None if name.split(".")[0] == "fastapi" else real(name, package)))
    config = load_config(None, [
        "rollout.agent.environment=agent-program",
        "rollout.agent.options.function=tests.unit.agent_programs:chat_agent"])
    text = "\n".join(dependency_problems(config, plugin_manager))
    assert ("rollout.agent.environment='agent-program' needs the fastapi package, which is "
            "not installed: pip install 'peerflow[endpoint]'") in text
