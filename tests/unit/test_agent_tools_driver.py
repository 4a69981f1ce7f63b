"""Tool failures through the real multi-turn driver (hf engine, tiny chat model).

A random model writes no tool calls, so the environment replaces the model's first turn
with a fixed call; everything else — the driver, the sandbox, the rendering — is real.
"""

from __future__ import annotations

import re

import attrs
import pytest

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents.rollout import AgentRollout
from peerflow.agents.tool_env import ToolEnvironment, ToolOptions
from peerflow.algorithms.base import Example
from peerflow.config import AgentConfig
from peerflow.engines import EngineContext
from peerflow.rollout.sampler import Draw
from tests.helpers.agent_tools import Hold, Raises

CALLS = {
    "raise": '<tool_call>{"name": "raises", "arguments": {}}</tool_call>',
    "slow": '<tool_call>{"name": "hold", "arguments": {"seconds": 60}}</tool_call>',
    "hold": '<tool_call>{"name": "hold", "arguments": {"seconds": 4}}</tool_call>',
    "none": "no call",
}


class ScriptedTools(ToolEnvironment):
    """Answers the first turn as if the model had written `CALLS[example.answer]`."""

    name = "scripted-tools"
    default_tools = (Raises, Hold)

    def step(self, turn):
        if turn.index == 0:
            turn = attrs.evolve(turn, text=CALLS[self.example.answer])
        return super().step(turn)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from tests.helpers.chat_model import build_chat_model

    path = build_chat_model(tmp_path_factory.mktemp("chat"))
    return HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout()))


def _run(engine, answers, **options):
    driver = AgentRollout(env_cls=ScriptedTools, env_options=ToolOptions(**options),
                          settings=AgentConfig(environment="scripted-tools", max_turns=2))
    draws = [Draw(position=i, example=Example(prompt="Go.", answer=a))
             for i, a in enumerate(answers)]
    return driver(engine, engine.tokenizer, draws,
                  SamplingParams(n=2, temperature=0.9, max_tokens=6, seed=3))


def test_a_raising_tool_ends_its_trajectory_marked_and_the_others_go_on(engine):
    batch = _run(engine, ["raise", "none"], end_on_error=True, timeout_s=30.0)
    assert list(batch["finish_reason"]) == ["env_error", "env_error", "stop", "stop"]
    errors = list(batch["agent_error"])
    assert all("raises: error: KeyError: 'no such record'" in e for e in errors[:2])
    assert errors[2:] == ["", ""]


def test_a_timed_out_tool_is_an_error_the_model_sees_and_the_episode_goes_on(engine):
    batch = _run(engine, ["slow"], timeout_s=2.0)
    assert list(batch["finish_reason"]) == ["stop", "stop"]  # the 2nd turn, no call, answers
    assert batch["num_turns"].tolist() == [2, 2]
    for row, mask in zip(batch.ragged("response_ids").rows(),
                         batch.ragged("loss_mask").rows()):
        observation = engine.tokenizer.decode(row[~mask].tolist())
        assert "Error: the tool 'hold' timed out after 2 s" in observation


def test_the_tool_calls_of_many_trajectories_run_at_the_same_time(engine):
    batch = _run(engine, ["hold", "hold", "hold"], timeout_s=60.0)
    spans = []
    for row, mask in zip(batch.ragged("response_ids").rows(), batch.ragged("loss_mask").rows()):
        observation = engine.tokenizer.decode(row[~mask].tolist())
        numbers = re.search(r"<tool_response>\s*([\d.]+),([\d.]+)", observation)
        spans.append((float(numbers.group(1)), float(numbers.group(2))))
    most_at_once = max(sum(start <= t < end for start, end in spans) for t, _ in spans)
    assert len(spans) == 6 and most_at_once == 6
