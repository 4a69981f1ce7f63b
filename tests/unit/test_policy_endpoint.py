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
         max_tokens: int = 6, wait_s: float = 60, **options):
    agent_programs.RECORDS.clear()
    draws = [Draw(position=i, example=Example(prompt=p, index=i))
             for i, p in enumerate(PROMPTS)]
    driver = AgentRollout(env_cls=AgentProgram,
                          env_options=_options(function, wait_s=wait_s, **options),
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
    for bad, text in (({"presence_penalty": 1.0}, "presence_penalty=1.0 is not supported"),
                      ({"n": 0}, "greater than or equal to 1"), ({"best_of": 4}, "best_of"),
                      ({"response_format": {"type": "json_object"}}, "structured output")):
        answer = httpx.post(url, json={**body, **bad}, headers=auth)
        assert answer.status_code == 400 and text in answer.json()["error"]["message"]
    generate = f"{root}/episodes/none/inference/v1/generate"
    answer = httpx.post(generate, json={"token_ids": [1], "stream": True}, headers=auth)
    assert answer.status_code == 400 and "stream" in answer.json()["error"]["message"]
    # session affinity: the episode is named by the route or the header, never two ways
    mixed = httpx.post(url, json=body, headers={**auth, "X-Session-Id": "other"})
    assert mixed.status_code == 400 and "names episodes" in mixed.json()["error"]["message"]
    named = httpx.post(f"{root}/v1/chat/completions", json=body,
                       headers={**auth, "X-Session-Id": "none"})
    assert named.status_code == 404 and "no open episode 'none'" in named.json()["error"][
        "message"]


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


class _Recording:
    """The engine, with every generate call's requests and settings kept (a test spy)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, sampling):
        self.calls.append(([list(r.prompt_ids) for r in requests], sampling))
        return self.engine.generate(requests, sampling)


def test_streamed_calls_are_recorded_like_whole_ones(engine):
    batch = _run(engine, "stream_agent", seed=3)
    records = list(agent_programs.RECORDS)
    assert len(batch) == 4 and batch["finish_reason"] == ["stop"] * 4
    assert batch["num_turns"].tolist() == [3] * 4  # every rebuilt call extended the last
    assert all(info.get("prefix_breaks", 0) == 0 for info in batch["agent_info"])
    for row in _rows(batch):
        assert sum(_matches(row, calls) for calls in records) >= 1
    for calls in records:
        for call in calls:  # the usage chunk, the finish chunk, one token id per chunk
            assert call["usage"] == {"prompt_tokens": len(call["prompt"]),
                                     "completion_tokens": len(call["ids"]),
                                     "total_tokens": len(call["prompt"]) + len(call["ids"]),
                                     "completion_tokens_details": None,
                                     "prompt_tokens_details": None}
            assert call["finish"] in ("stop", "length") and len(call["logprobs"]) == len(
                call["ids"])


def test_stream_deltas_concatenate_to_the_answer_text(tok):
    from peerflow.agents.endpoint.stream import text_deltas

    ids = tuple(tok("héllo wörld <|im_end|>", add_special_tokens=False)["input_ids"])
    for skip in (True, False):
        text = tok.decode(list(ids), skip_special_tokens=skip)
        deltas = text_deltas(text, ids, tok, skip)
        assert len(deltas) == len(ids) and "".join(deltas) == text
        assert sum(bool(d) for d in deltas) > 1  # streamed, not one chunk at the end
    content = tok.decode(list(ids[:3]), skip_special_tokens=True)  # a tool call's prefix
    assert "".join(text_deltas(content, ids, tok, True)) == content


def test_n_choices_each_become_a_sample_and_the_chosen_one_goes_on(engine):
    from peerflow.agents.rollout import SEGMENT_STRIDE

    batch = _run(engine, "choices_agent", seed=5, max_n=3)  # 3 choices, above the run's n
    records = list(agent_programs.RECORDS)
    assert len(batch) == 12  # 4 episodes: the trajectory and 2 branches each
    reasons = batch["finish_reason"]
    assert sorted(reasons) == ["branch"] * 8 + ["stop"] * 4
    rows = _rows(batch)
    for calls in records:
        choices, second = calls[:3], calls[3]
        assert second["usage"] == sum(len(c["ids"]) for c in choices)
        # the trajectory: choice 2, the observation, the second answer — token-exact
        assert sum(_matches(row, [choices[2], second]) for row, r in zip(rows, reasons)
                   if r == "stop") == 1
        for branch in choices[:2]:  # the others: samples of their own, prompt + answer
            assert any(r == "branch" and _matches(row, [branch]) for row, r in zip(rows,
                                                                                  reasons))
    ids = batch.sample_id.tolist()
    assert len(set(ids)) == 12 and sum(i >= SEGMENT_STRIDE for i in ids) == 8
    assert sorted(batch.group_id.tolist()) == [0] * 6 + [1] * 6
    assert batch["env_reward"].tolist() == [0.5] * 12
    assert all(batch["agent_info"][i]["branches"] == 1 for i, r in enumerate(reasons)
               if r == "branch")


def test_per_request_sampling_is_honoured_or_refused_by_name(engine):
    spy = _Recording(engine)
    batch = _run(spy, "sampling_agent", n=2)
    (record,) = agent_programs.RECORDS[:1]
    refused = record[0]["refused"]
    assert len(refused) == 5
    assert "rollout.sampling.temperature=1.0" in refused[0]
    assert "rollout.sampling.top_p=1.0" in refused[1]
    assert "top_logprobs=2" in refused[2] and "presence_penalty" in refused[3]
    assert "min_p" in refused[4]
    for row in _rows(batch):
        assert sum(_matches(row, calls) for calls in agent_programs.RECORDS) >= 1
        assert len(row[1]) <= 2  # max_completion_tokens
    for calls in agent_programs.RECORDS:
        assert calls[0]["finish"] == ("length" if len(calls[0]["ids"]) == 2 else "stop")
    (prompts, sampling), = spy.calls  # one engine call: both groups' shared settings
    assert sampling.seed == 11 and sampling.stop == ("zz",) and sampling.n == 2
    assert sampling.max_tokens == 2 and sampling.temperature == 1.0
    assert len(prompts) == 2


def test_agent_failing_before_its_first_call_loses_only_its_episode(engine):
    agent_programs._STARTS.clear()
    batch = _run(engine, "early_agent", n=3, wait_s=2.0)
    reasons, errors = batch["finish_reason"], batch["agent_error"]
    assert sorted(reasons) == ["env_error"] * 3 + ["stop"] * 3
    text = " | ".join(errors)
    assert "raised ValueError: no model for me" in text
    assert "ended before calling the model: 1.0" in text
    assert "rollout.agent.options.wait_s=2.0" in text
    for row, reason in zip(_rows(batch), reasons):
        prompt, response, _, _ = row
        assert len(prompt) > 0 and (len(response) == 0) == (reason == "env_error")
    assert [r for r, e in zip(batch["env_reward"].tolist(), reasons) if e == "stop"] == [
        0.25] * 3


def test_session_affinity_routes_each_trajectory_to_its_engine(engine):
    from peerflow.agents.endpoint.server import route_episode

    assert route_episode("e1", None, {}) == ("e1", "")
    assert route_episode(None, "e1", {}) == ("e1", "")
    assert route_episode(None, None, {"session_id": "e1"}) == ("e1", "")
    assert route_episode("e1", "e1", {"session_id": "e1"}) == ("e1", "")
    assert route_episode("e1", "e2", {})[0] is None
    assert route_episode(None, None, {})[1].startswith("calls are recorded per episode")
    spy = _Recording(engine)
    batch = _run(spy, "session_agent", max_turns=2)
    assert batch["finish_reason"] == ["stop"] * 4 and batch["num_turns"].tolist() == [2] * 4
    first, second = spy.calls
    assert len(first[0]) == 2 and len(second[0]) == 4  # a group shares its first prompt
    # every later turn of a trajectory was asked of the same engine with the earlier turn
    # as its prefix: what vLLM's prefix cache reuses
    for prompt, response, _, mask in _rows(batch):
        m = mask.tolist()
        start = m.index(True, m.index(False))  # the second turn's first sampled token
        assert prompt.tolist() + response.tolist()[:start] in second[0]


def test_streamed_tool_calls_parse_as_openai_chunks(tok):
    from openai.types.chat import ChatCompletionChunk
    from openai.types.completion import Completion

    from peerflow.agents.endpoint.protocol import Call, Reply
    from peerflow.agents.endpoint.sampling import RequestSampling
    from peerflow.agents.endpoint.stream import chat_chunks, completion_chunks

    text = 'ok <tool_call>{"name": "count", "arguments": {"text": "a"}}</tool_call>'
    ids = tuple(tok(text, add_special_tokens=False)["input_ids"])
    reply = Reply(prompt_ids=(1, 2), token_ids=ids, logprobs=(-0.5,) * len(ids), text=text,
                  finish_reason="stop")
    message = {"role": "assistant", "content": "ok ", "tool_calls": [
        {"id": "call_0_0", "type": "function",
         "function": {"name": "count", "arguments": '{"text": "a"}'}}]}
    call = Call(kind="chat", sampling=RequestSampling(logprobs=True), return_token_ids=True,
                model="policy", stream=True, include_usage=True)
    events = chat_chunks(call, [reply, reply], [(message, "tool_calls")] * 2, tok)
    chunks = [ChatCompletionChunk.model_validate(e) for e in events]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == "ok "
        assert [t for c in mine for t in (getattr(c, "token_ids", None) or [])] == list(ids)
        assert mine[-1].finish_reason == "tool_calls"
        (calls,) = [c.delta.tool_calls for c in mine if c.delta.tool_calls]
        assert calls[0].function.name == "count" and calls[0].id == "call_0_0"
    assert chunks[0].prompt_token_ids == [1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(ids)
    plain = Call(kind="completion", sampling=RequestSampling(logprobs=True), stream=True)
    pieces = completion_chunks(plain, [reply], tok)
    assert "".join(p["choices"][0]["text"] for p in pieces) == text
    offsets = [p["choices"][0]["logprobs"]["text_offset"][0] for p in pieces[:-1]]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert Completion.model_validate(pieces[-1]).choices[0].finish_reason == "stop"


def test_sampling_refusals_name_the_setting_and_greedy_eval_accepts_them():
    from peerflow.agents.endpoint.sampling import refusal, request_sampling
    from peerflow.capabilities import Capabilities

    caps = Capabilities(logprobs=True)
    ask = request_sampling("chat", {"temperature": 0.7, "top_k": 5, "stop": "x"})
    refused = refusal(ask, SamplingParams(), caps)
    assert refused.param == "temperature" and "rollout.sampling.temperature=1.0" in str(refused)
    assert "Capabilities.stop_strings" in str(refusal(
        request_sampling("chat", {"stop": "x"}), SamplingParams(), caps))
    greedy = SamplingParams(temperature=0.0)
    assert "stop_strings" in str(refusal(ask, greedy, caps))  # what greedy does not excuse
    assert refusal(ask, greedy, Capabilities(logprobs=True, stop_strings=True)) is None
    generate = request_sampling("generate", {"sampling_params": {"max_tokens": 3, "n": 2,
                                                                 "seed": 4}})
    assert generate.turn_settings().n == 2 and generate.max_tokens == 3 and generate.logprobs
    assert request_sampling("completion", {"logprobs": 1}).top_logprobs == 0
    assert request_sampling("completion", {"logprobs": 3}).top_logprobs == 2


def test_a_group_whose_first_calls_differ_fails_alone_and_is_told_why(engine):
    agent_programs.TOLD.clear()
    batch = _run(engine, "stamped_agent", max_turns=1)
    reasons, errors = batch["finish_reason"], batch["agent_error"]
    stamped = [i for i, e in enumerate(batch["example"]) if e.prompt == "ab"]
    assert [reasons[i] for i in stamped] == ["env_error"] * 2
    assert all(r != "env_error" for i, r in enumerate(reasons) if i not in stamped)
    assert "different first prompts" in errors[stamped[0]]
    assert batch["agent_failure"][stamped[0]]["type"] == "DivergentFirstPrompts"
    # each program heard the reason: 500 on its waiting call, then 503 naming it again
    told = sorted(agent_programs.TOLD)
    assert [status for status, _ in told] == [500, 500, 503, 503]
    assert all("different first prompts" in text for _, text in told)
    assert not any("rollout.agent limit" in text for _, text in told)
