"""The multi-turn driver on the hf engine: token exactness, masks, limits, failing envs."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

import pytest
import torch

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents import Environment, StepResult, Turn
from peerflow.agents.rollout import LOSS_MASK, AgentRollout
from peerflow.algorithms.base import Example
from peerflow.config import AgentConfig
from peerflow.engines import EngineContext
from peerflow.rollout.sampler import Draw
from peerflow.streaming.versions import TOKEN_VERSIONS

TEMPERATURE = 0.7
PROMPTS = ["12>", "407>", "9>"]


class Echo(Environment):
    """Answers every turn with a fixed text observation; done after `turns` turns."""

    name: ClassVar[str] = "echo-test"
    turns = 3
    observation = "\nok, more: "

    def step(self, turn: Turn) -> StepResult:
        done = turn.index + 1 >= self.turns
        return StepResult(observation="" if done else self.observation, reward=0.25,
                          done=done, info={"calls": 2, "note": "text is not a metric"})

    def final_reward(self) -> float:
        return 1.0


def _draws(prompts=PROMPTS) -> list[Draw]:
    return [Draw(position=10 + i, example=Example(prompt=p, answer=p[:-1][::-1], index=i))
            for i, p in enumerate(prompts)]


def _driver(env_cls=Echo, **limits) -> AgentRollout:
    settings = AgentConfig(environment=env_cls.name, **limits)
    return AgentRollout(env_cls=env_cls, env_options=None, settings=settings)


def _sampling(n=2, max_tokens=6, seed=11) -> SamplingParams:
    return SamplingParams(n=n, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                          max_tokens=max_tokens, seed=seed)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    return HFRolloutEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout(), seed=5))


@pytest.fixture(scope="module")
def batch(engine):
    return _driver(max_turns=3, max_total_tokens=200)(
        engine, engine.tokenizer, _draws(), _sampling())


def _rows(batch, name):
    return [r.tolist() for r in batch.ragged(name).rows()]


def test_trajectories_are_groups_of_n_episodes(batch):
    assert len(batch) == len(PROMPTS) * 2
    assert batch.group_id.tolist() == [10, 10, 11, 11, 12, 12]
    assert batch.sample_id.tolist() == [20, 21, 22, 23, 24, 25]
    assert batch["finish_reason"] == ["stop"] * 6
    assert batch["num_turns"].tolist() == [3] * 6
    for rewards, mask in zip(_rows(batch, "token_rewards"), _rows(batch, LOSS_MASK)):
        # each turn's reward sits on its last sampled token
        ends = [i for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]
        assert [i for i, r in enumerate(rewards) if r] == ends
        assert [rewards[i] for i in ends] == [0.25] * 3
    assert batch["env_reward"].tolist() == [1.0] * 6
    assert batch["agent_error"] == [""] * 6
    assert batch["agent_info"] == [{"calls": 6.0}] * 6


def test_episode_metrics(batch):
    from peerflow.agents.rollout import record_episode_metrics
    from peerflow.worker.metrics import StepMetrics, reduce_metrics

    metrics = StepMetrics()
    record_episode_metrics(batch, metrics)
    got = reduce_metrics([metrics.raw()])
    assert got["agent/turns_mean"] == got["agent/turns_max"] == 3
    assert got["agent/finish/stop"] == 1 and got["agent/finish/env_error"] == 0
    assert got["agent/calls"] == 6 and got["agent/turn_reward_mean"] == 0.75
    assert got["agent/versions_max"] == 1
    assert got["agent/observation_tokens"] == 6 * 2 * len(Echo.observation)


def test_loss_mask_is_false_exactly_on_observation_tokens(engine, batch):
    obs = engine.tokenizer(Echo.observation, add_special_tokens=False)["input_ids"]
    for ids, mask, lps in zip(_rows(batch, "response_ids"), _rows(batch, LOSS_MASK),
                              _rows(batch, "rollout_logprobs"), strict=True):
        # three model turns separated by two observations (no chat template: plain text)
        runs, start = [], 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                runs.append((mask[start], start, i))
                start = i
        assert [m for m, _, _ in runs] == [True, False, True, False, True]
        for sampled, a, b in runs:
            if not sampled:
                assert ids[a:b] == obs
                assert lps[a:b] == [0.0] * (b - a)
            else:
                assert all(lp < 0 for lp in lps[a:b])


def test_train_engine_logprobs_equal_rollout_logprobs(tiny_model, batch):
    """Token exactness: the trainer scores the sampled ids with the sampled log-probs."""
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.engines import OptimSettings

    trainer = FSDPTrainEngine(
        EngineContext(model_path=tiny_model, layout=ParallelLayout(), temperature=TEMPERATURE),
        FSDPTrainOptions(), OptimSettings())
    trained = [r.tolist() for r in trainer.forward_logprobs(batch).rows()]
    for got, want, mask in zip(trained, _rows(batch, "rollout_logprobs"), _rows(batch, LOSS_MASK),
                               strict=True):
        got, want = torch.tensor(got), torch.tensor(want)
        keep = torch.tensor(mask)
        assert keep.sum() > 0
        assert torch.allclose(got[keep], want[keep], atol=1e-4), (got[keep] - want[keep]).abs()
    trainer.shutdown()


def test_weight_versions_per_token(batch):
    assert _rows(batch, TOKEN_VERSIONS) == [[0] * n for n in batch.lengths("response_ids")
                                           .tolist()]
    assert batch.weight_version.tolist() == [0] * len(batch)


def test_between_turns_new_weights_start_a_new_segment(engine):
    """A trajectory spans versions when weights change between its turns (async mode)."""
    calls = []

    def between():  # stands in for the rollout loop applying version 1, then 2
        engine.begin_weight_update(len(calls) + 1)
        engine.finish_weight_update()
        calls.append(engine.weight_version)

    try:
        out = _driver(max_turns=3)(engine, engine.tokenizer, _draws(PROMPTS[:1]), _sampling(),
                                   between=between)
    finally:
        engine.begin_weight_update(0)
        engine.finish_weight_update()
    assert calls == [1, 2]
    for versions, mask in zip(_rows(out, TOKEN_VERSIONS), _rows(out, LOSS_MASK)):
        turns = [v for v, m, prev in zip(versions, mask, [False, *mask]) if m and not prev]
        assert turns == [0, 1, 2]  # each turn's tokens carry the version that sampled them
        assert versions == sorted(versions)
    assert out.weight_version.tolist() == [0, 0]  # the oldest segment


def test_turn_and_total_token_limits(engine):
    out = _driver(max_turns=3, max_turn_tokens=3, max_total_tokens=9)(
        engine, engine.tokenizer, _draws(), _sampling(max_tokens=50))
    for ids, mask, reason in zip(_rows(out, "response_ids"), _rows(out, LOSS_MASK),
                                 out["finish_reason"], strict=True):
        assert len(ids) <= 9
        assert sum(mask) <= 9
        assert reason in ("stop", "max_tokens")
    # turns of at most 3 sampled tokens; an 11-token observation never fits after 3 tokens
    assert set(out["finish_reason"]) == {"max_tokens"}
    assert all(len(ids) <= 3 for ids in _rows(out, "response_ids"))


def test_max_turns_and_observation_truncation(engine):
    class Forever(Echo):
        turns = 100

    out = _driver(Forever, max_turns=2, max_observation_tokens=4)(
        engine, engine.tokenizer, _draws(), _sampling())
    assert out["finish_reason"] == ["max_turns"] * 6
    assert out["num_turns"].tolist() == [2] * 6
    obs = engine.tokenizer(Echo.observation, add_special_tokens=False)["input_ids"][:4]
    for ids, mask in zip(_rows(out, "response_ids"), _rows(out, LOSS_MASK)):
        observed = [t for t, m in zip(ids, mask) if not m]
        assert observed == obs


class Flaky(Echo):
    """Prompt "9>" raises at its second turn; "407>" hangs; "12>" works."""

    name: ClassVar[str] = "flaky-test"
    release = threading.Event()

    def step(self, turn: Turn) -> StepResult:
        if self.example.prompt == "9>" and turn.index == 1:
            raise ValueError("tool crashed")
        if self.example.prompt == "407>":
            self.release.wait(30)  # far past the step limit
        return super().step(turn)


def test_raising_and_hanging_environments_end_only_their_trajectory(engine):
    try:
        out = _driver(Flaky, max_turns=3, step_timeout_s=1.0, concurrency=2)(
            engine, engine.tokenizer, _draws(), _sampling())
    finally:
        Flaky.release.set()
    assert out["finish_reason"] == ["stop", "stop", "env_timeout", "env_timeout",
                                    "env_error", "env_error"]
    assert out["num_turns"].tolist() == [3, 3, 1, 1, 2, 2]
    errors = out["agent_error"]
    assert errors[:2] == ["", ""]
    assert "step_timeout_s=1.0" in errors[2]
    assert errors[4] == "flaky-test.step raised ValueError: tool crashed"
    # each failure keeps its traceback (RUN_DIR/agent_errors.jsonl): where it was raised
    failure = out["agent_failure"][4]
    assert failure["type"] == "ValueError" and "in step" in failure["traceback"]
    assert failure["traceback"].endswith("ValueError: tool crashed")
    assert out["agent_failure"][2]["type"] == "TimeoutError" and out["agent_failure"][0] == {}
    # the failed trajectories keep what they sampled, masks aligned
    for ids, mask in zip(_rows(out, "response_ids"), _rows(out, LOSS_MASK)):
        assert len(ids) == len(mask) and mask[0]


class Stamped(Echo):
    """A system prompt with a timestamp on one row: that group's first prompts differ."""

    told: ClassVar[list[str]] = []

    def initial_prompt(self):
        if self.example.prompt == "407>":
            return f"[{time.monotonic_ns()}] {self.example.prompt}"
        return super().initial_prompt()

    def turn_failed(self, error):
        Stamped.told.append(error)


def test_a_group_whose_first_prompts_differ_is_one_failed_group(engine):
    Stamped.told.clear()
    out = _driver(Stamped, max_turns=2)(engine, engine.tokenizer, _draws(), _sampling())
    assert out["finish_reason"] == ["max_turns"] * 2 + ["env_error"] * 2 + ["max_turns"] * 2
    error = out["agent_error"][2]
    assert "different first prompts" in error and "timestamp" in error
    assert "dataset row 2" in error
    assert out["agent_failure"][2] == {"type": "DivergentFirstPrompts", "traceback": ""}
    assert Stamped.told == [error, error]  # the episodes hear why (an agent program: 500)
    assert _rows(out, "response_ids")[2] == [] and all(_rows(out, "response_ids")[i]
                                                       for i in (0, 1, 4, 5))


class Long(Echo):
    """One row's first prompt is longer than the tiny model's 256 positions."""

    def initial_prompt(self):
        return self.example.prompt * (100 if self.example.prompt == "407>" else 1)


@pytest.mark.parametrize("prompts", [PROMPTS, ["407>"]], ids=["one-of-three", "the-only-one"])
def test_a_first_prompt_past_the_context_fails_its_group_not_the_batch(engine, prompts):
    out = _driver(Long, max_turns=2)(engine, engine.tokenizer, _draws(prompts), _sampling())
    failed = [i for i, r in enumerate(out["finish_reason"]) if r == "env_error"]
    assert [out["example"][i].prompt for i in failed] == ["407>", "407>"]
    assert len(out) == 2 * len(prompts)
    error = out["agent_error"][failed[0]]
    assert "the first prompt has 400 tokens" in error and "context of 256" in error
    assert "rollout.agent limit" not in error
    assert out["agent_failure"][failed[0]]["type"] == "PromptPastContext"


def test_async_generate_with_partial_rollout_splits_turns_into_version_segments(engine):
    """Through the async loop's `make_generate`: `between` runs between chunks of a turn
    and between turns; every sampled token keeps the version that produced it."""
    from peerflow.streaming.rollout_loop import make_generate

    driver = _driver(max_turns=2)
    generate = make_generate(
        engine, lambda eng, draws, sampling, **kw: driver(eng, eng.tokenizer, draws, sampling,
                                                          **kw),
        partial_rollout=True, chunk_tokens=2, multi_turn=True)
    versions_seen = []

    def between():
        engine.begin_weight_update(engine.weight_version + 1)
        engine.finish_weight_update()
        versions_seen.append(engine.weight_version)

    try:
        out = generate(_draws(PROMPTS[:2]), _sampling(max_tokens=6), between)
    finally:
        engine.begin_weight_update(0)
        engine.finish_weight_update()
    assert versions_seen  # chunks and turns let new weights in
    spans_in_a_turn = 0
    for versions, mask in zip(_rows(out, TOKEN_VERSIONS), _rows(out, LOSS_MASK)):
        assert versions == sorted(versions) and versions[0] == 0
        first_turn = versions[:mask.index(False)] if False in mask else versions
        spans_in_a_turn += len(set(first_turn)) > 1
    assert spans_in_a_turn > 0  # a 6-token turn in 2-token chunks spans versions
    assert out.weight_version.tolist() == [0] * len(out)


def test_failing_final_reward_and_close_are_marked_not_raised(engine):
    class Broken(Echo):
        def final_reward(self) -> float:
            raise RuntimeError("scorer down")

        def close(self) -> None:
            raise OSError("already gone")

    out = _driver(Broken, max_turns=3)(engine, engine.tokenizer, _draws(PROMPTS[:1]), _sampling())
    assert out["finish_reason"] == ["env_error"] * 2
    assert out["agent_error"] == ["echo-test.final_reward raised RuntimeError: scorer down"] * 2
    assert torch.isnan(out["env_reward"]).all()  # the task's reward scores these


def test_an_environment_that_cannot_start_names_itself_and_closes_the_others(engine):
    closed = []

    class Fragile(Echo):
        def __init__(self, example, options):
            if example.prompt == "407>":
                raise KeyError("no such level")
            super().__init__(example, options)

        def close(self) -> None:
            closed.append(self.example.prompt)

    with pytest.raises(RuntimeError, match=r"environment 'echo-test' could not start an "
                                           r"episode for dataset row 2 \(KeyError"):
        _driver(Fragile)(engine, engine.tokenizer, _draws(), _sampling())
    assert closed == ["12>", "12>"]


def test_a_first_prompt_that_fails_ends_only_its_episodes(engine):
    class NoStart(Echo):
        def initial_prompt(self):
            if self.example.prompt == "407>":
                raise ValueError("no prompt today")
            return super().initial_prompt()

    out = _driver(NoStart, max_turns=2)(engine, engine.tokenizer, _draws(), _sampling())
    assert out["finish_reason"] == ["max_turns"] * 2 + ["env_error"] * 2 + ["max_turns"] * 2
    assert out["agent_error"][2] == ("echo-test.initial prompt raised ValueError: no prompt "
                                     "today")
    prompts, responses = _rows(out, "prompt_ids"), _rows(out, "response_ids")
    from peerflow.rollout.prompts import encode_prompt

    assert prompts[2] == prompts[3] == encode_prompt(engine.tokenizer, "407>")  # stand-in
    assert responses[2] == responses[3] == [] and all(responses[i] for i in (0, 1, 4, 5))
