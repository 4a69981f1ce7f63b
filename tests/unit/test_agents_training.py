"""Multi-turn trajectories from the real driver (hf engine) trained by the fsdp engine.

The driver's `loss_mask` (false on observation tokens, whose `rollout_logprobs` are 0)
must keep the off-policy weights and mismatch at their on-policy values, the advantage
estimator must see trajectory rewards (outcome + per-turn), and one step must improve
the surrogate on the model's tokens.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents import Environment, StepResult, Turn
from peerflow.agents.rollout import AgentRollout
from peerflow.algorithms.base import Example
from peerflow.algorithms.setup import build_algorithm
from peerflow.config import AgentConfig, AlgorithmConfig, structure
from peerflow.engines import EngineContext, OptimSettings
from peerflow.rollout.sampler import Draw
from peerflow.worker.metrics import StepMetrics, reduce_metrics

TEMPERATURE = 0.8


class CountDigits(Environment):
    """Two turns; turn reward 0.1 per digit the model wrote, outcome 1 if it wrote any."""

    name: ClassVar[str] = "count-digits-test"

    def __init__(self, example, options) -> None:
        super().__init__(example, options)
        self.digits = 0

    def step(self, turn: Turn) -> StepResult:
        found = sum(ch.isdigit() for ch in turn.text)
        self.digits += found
        return StepResult(observation=" and? ", reward=0.1 * found, done=turn.index >= 1)

    def final_reward(self) -> float:
        return float(self.digits > 0)


@pytest.fixture(scope="module")
def trajectories(tiny_model):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout(),
                                           seed=3))
    driver = AgentRollout(env_cls=CountDigits, env_options=None,
                          settings=AgentConfig(environment=CountDigits.name, max_turns=2))
    draws = [Draw(position=i, example=Example(prompt=p, index=i))
             for i, p in enumerate(["12+3=", "7*8=", "abc"])]
    sampling = SamplingParams(n=4, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                              max_tokens=5, seed=13)
    batch = driver(engine, engine.tokenizer, draws, sampling)
    batch.set("reward", batch["env_reward"].to(torch.float64))  # what the reward node does
    return batch


def test_a_driver_batch_trains_only_its_model_tokens(tiny_model, trajectories):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions

    batch = trajectories
    mask = batch.loss_mask()
    assert 0 < int(mask.sum()) < len(mask)
    algo = build_algorithm(structure(AlgorithmConfig, {"advantage": "grpo"}))
    outcome = batch["reward"].clone()
    algo.shape_rewards(batch, StepMetrics())
    turn_sums = torch.tensor([float(r.sum()) for r in batch.ragged("token_rewards").rows()],
                             dtype=torch.float64)
    torch.testing.assert_close(batch["reward"], outcome + turn_sums)
    for name, column in algo.estimator.compute(batch).items():
        batch.set(name, column)
    advantages = batch.ragged("advantages").values
    assert torch.all(advantages[~mask] == 0) and advantages[mask].abs().sum() > 0

    trainer = FSDPTrainEngine(
        EngineContext(model_path=tiny_model, layout=ParallelLayout(), temperature=TEMPERATURE),
        FSDPTrainOptions(), OptimSettings(lr=1e-4))
    try:
        batch.set("old_logprobs", trainer.forward_logprobs(batch))
        metrics = StepMetrics()
        actor_batch = algo.prepare_actor_batch(batch, metrics)
        step = reduce_metrics([metrics.raw()])
        # observations (rollout log-prob 0) are out: trainer and rollout agree on the rest
        assert step["mismatch/abs_max"] < 1e-3
        assert step["off_policy/is_weight_max"] == pytest.approx(1.0, abs=1e-3)
        trainer.train_step(actor_batch, algo.policy_loss)
        after = trainer.forward_logprobs(batch).values
    finally:
        trainer.shutdown()
    before = batch.ragged("old_logprobs").values
    # first-order improvement of the surrogate sum_t A_t logp_t on the model's tokens
    gain = (advantages.float() * (after - before))[mask].sum()
    assert float(gain) > 0
