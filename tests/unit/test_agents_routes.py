"""Multi-turn trajectories of a MoE model carry routes: model tokens routed, observations -1."""

from __future__ import annotations

from typing import ClassVar

import torch

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents import Environment, StepResult, Turn
from peerflow.agents.rollout import LOSS_MASK, AgentRollout
from peerflow.algorithms.base import Example
from peerflow.config import AgentConfig
from peerflow.engines import EngineContext, OptimSettings
from peerflow.rollout.sampler import Draw
from peerflow.routes import ROUTES


class TwoTurns(Environment):
    """Answers the first turn with a text observation; done after the second."""

    name: ClassVar[str] = "two-turns-routes-test"

    def step(self, turn: Turn) -> StepResult:
        done = turn.index >= 1
        return StepResult(observation="" if done else "\nok: ", reward=0.0, done=done)

    def final_reward(self) -> float:
        return 1.0


def test_multi_turn_routes_cover_the_sequence_and_replay_on_fsdp(tmp_path):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from tests.engines.fsdp.fsdp_testlib import nll_loss
    from tests.engines.hf.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_experts=4, top_k=2)
    engine = HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout(), seed=2))
    driver = AgentRollout(env_cls=TwoTurns, env_options=None, settings=AgentConfig(
        environment=TwoTurns.name, max_turns=2, max_total_tokens=100))
    draws = [Draw(position=i, example=Example(prompt=p, answer="", index=i))
             for i, p in enumerate(["12>", "abc>"])]
    batch = driver(engine, engine.tokenizer, draws,
                   SamplingParams(n=2, temperature=0.7, max_tokens=5, seed=3))
    routes = batch.ragged(ROUTES)
    assert torch.equal(routes.lengths, batch.lengths("prompt_ids") + batch.lengths("response_ids"))
    observed = 0
    for i in range(len(batch)):
        prompt = int(batch.lengths("prompt_ids")[i])
        row, mask = routes.row(i), batch.ragged(LOSS_MASK).row(i)
        assert bool((row[:prompt] >= 0).all())
        answer = row[prompt:]
        assert bool((answer[~mask] == -1).all())  # observation tokens: no route
        observed += int((~mask).sum())
        sampled = answer[mask]
        assert bool((sampled[-1] == -1).all()) and bool((sampled[0] >= 0).all())
    assert observed > 0
    context = EngineContext(model_path=path, layout=ParallelLayout(), temperature=0.7)
    trainer = FSDPTrainEngine(context, None, OptimSettings(routing_replay="r3"))
    trainer.forward_logprobs(batch)
    metrics = trainer.train_step(batch, nll_loss)
    assert metrics["moe/replay_no_overlap"] == 0.0 and metrics["moe/rows_without_routes"] > 0
