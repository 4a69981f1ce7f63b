"""Failed samples: trajectories the environment failed (`rollout.agent.on_env_error`) and
samples whose reward failed (`task.reward_limits.on_failure`) are left out of training, and
dynamic sampling refills the groups that leaves out.

The environment is the calculator example (`calculator-arithmetic`, the real `calculator`
tool run in the sandbox) on a tiny random Qwen2 chat model (hf engine, temperature 0.8):
a random model writes no tool calls, so each episode's first turn is answered as if the
model had called the calculator; then every fourth episode's sandbox "goes down" — its
`step` raises — and its broken environment reports a garbage reward (`CORRUPT`), so any
leak of a failed trajectory into a baseline, a normaliser or a gradient shows.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading

import attrs
import pytest
import torch

from peerflow import ParallelLayout, SamplingParams
from peerflow.agents.rollout import AgentRollout, record_episode_metrics
from peerflow.algorithms.advantages import GRPO, ReinforcePP
from peerflow.algorithms.base import Example
from peerflow.algorithms.dynamic_sampling import filter_groups
from peerflow.algorithms.failed_samples import (
    ENV_EXCLUDED,
    REWARD_FAILED,
    apply_failure_policies,
    estimate_advantages,
    failure_exclusions,
)
from peerflow.algorithms.setup import build_algorithm
from peerflow.config import AgentConfig, AlgorithmConfig, structure
from peerflow.contrib.tasks.tool_arithmetic import CalculatorArithmetic
from peerflow.engines import EngineContext, OptimSettings
from peerflow.rollout.sampler import Draw
from peerflow.worker.metrics import StepMetrics, reduce_metrics

TEMPERATURE = 0.8
N = 3
PROMPTS = 4
CORRUPT = 10.0
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "4821 * 7733"}}</tool_call>'


class FlakyCalculator(CalculatorArithmetic):
    """The calculator example whose sandbox is down for every fourth episode (2nd turn)."""

    name = "flaky-calculator-test"
    serials = itertools.count()
    lock = threading.Lock()

    def __init__(self, example, options) -> None:
        super().__init__(example, options)
        with self.lock:  # episodes are created in trajectory order, before any step
            self.broken = next(self.serials) % 4 == 1
        self.crashed = False

    def step(self, turn):
        if turn.index == 0:
            turn = attrs.evolve(turn, text=CALL)
        elif self.broken:
            self.crashed = True
            raise ConnectionError("sandbox pool unreachable (connection refused)")
        return super().step(turn)

    def final_reward(self) -> float:
        """Garbage from a broken episode; else a spread-out score of the model's answer."""
        return CORRUPT if self.crashed else (len(set(self.answer)) % 5) / 4


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    from tests.helpers.chat_model import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def episodes(chat_model):
    """A fresh batch per test: 4 prompts × 3 trajectories, the reward node's `reward`."""
    from peerflow.adapters.hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(EngineContext(model_path=chat_model, layout=ParallelLayout(),
                                           seed=7))
    FlakyCalculator.serials = itertools.count()
    driver = AgentRollout(env_cls=FlakyCalculator, env_options=FlakyCalculator.options_class(),
                          settings=AgentConfig(environment=FlakyCalculator.name, max_turns=3))
    draws = [Draw(position=i, example=Example(prompt="What is 4821 * 7733?",
                                              answer="37280793", index=i))
             for i in range(PROMPTS)]
    batch = driver(engine, engine.tokenizer, draws,
                   SamplingParams(n=N, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                                  max_tokens=8, seed=5))
    batch.set("reward", batch["env_reward"].to(torch.float64))  # what the reward node does
    return batch


@pytest.fixture
def batch(episodes):
    return episodes.select(list(range(len(episodes))))


def _failed(batch) -> list[bool]:
    return [r == "env_error" for r in batch["finish_reason"]]


def test_a_broken_sandbox_ends_only_its_own_trajectories(episodes):
    batch = episodes
    assert sorted(batch.sample_id.tolist()) == list(range(PROMPTS * N))  # nothing lost
    failed = _failed(batch)
    assert failed == [i % 4 == 1 for i in range(PROMPTS * N)]
    for i, (reason, error) in enumerate(zip(batch["finish_reason"], batch["agent_error"])):
        if failed[i]:
            assert error == ("flaky-calculator-test.step raised ConnectionError: sandbox pool "
                             "unreachable (connection refused)")
        else:
            assert reason == "stop" and error == ""
    # every trajectory, failed or not, got the calculator's result as an observation
    assert all(0 < int(m.sum()) < len(m) for m in batch.ragged("loss_mask").rows())
    assert len(set(batch.lengths("response_ids").tolist())) > 1  # ragged
    assert batch["reward"][torch.tensor(failed)].eq(CORRUPT).all()


def _grpo(rewards: list[float]) -> list[float]:
    """GRPO over one group: (r - mean) / (unbiased std + 1e-6), 0 for a group of one."""
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + 1e-6) for r in rewards]


def _per_sample(batch) -> list[float]:
    """Each sample's advantage (the value on its trained tokens; 0 when it has none)."""
    out = []
    for adv, mask in zip(batch.ragged("advantages").rows(), batch.ragged("loss_mask").rows()):
        assert torch.all(adv[~mask] == 0)
        values = adv[mask].unique()
        assert len(values) == 1
        out.append(float(values[0]))
    return out


@pytest.mark.parametrize("policy", ["drop_group", "mask", "train"])
def test_the_policy_decides_which_trajectories_train_and_form_baselines(batch, policy):
    failed = torch.tensor(_failed(batch))
    keep = apply_failure_policies(batch, policy, "train")
    groups = batch.group_id.tolist()
    bad_groups = {g for g, f in zip(groups, failed.tolist()) if f}
    expected_keep = {"drop_group": [g not in bad_groups for g in groups],
                     "mask": (~failed).tolist(), "train": [True] * len(batch)}[policy]
    assert keep.tolist() == expected_keep
    assert batch[ENV_EXCLUDED].tolist() == [not k for k in expected_keep]
    if policy == "train":
        assert "train_mask" not in batch
    else:
        assert batch["train_mask"].tolist() == expected_keep
    for name, column in estimate_advantages(GRPO(), batch, keep).items():
        batch.set(name, column)
    # the expected advantages: GRPO within each group over its kept trajectories only
    rewards = batch["reward"].tolist()
    want = [0.0] * len(batch)
    for g in set(groups):
        members = [i for i, gi in enumerate(groups) if gi == g and expected_keep[i]]
        for i, a in zip(members, _grpo([rewards[i] for i in members])):
            want[i] = a
    assert _per_sample(batch) == pytest.approx(want, abs=1e-5)
    if policy != "train":  # the garbage reward moved no kept advantage
        assert max(abs(a) for a in want) < 2.0

    metrics = StepMetrics()
    record_episode_metrics(batch, metrics)
    got = reduce_metrics([metrics.raw()])
    assert got["agent/env_errors"] == int(failed.sum()) == 3
    assert got["agent/env_dropped_fraction"] == pytest.approx(
        1 - sum(expected_keep) / len(batch))


def test_left_out_trajectories_take_no_part_in_batch_whitening(batch):
    keep = apply_failure_policies(batch, "drop_group", "train")
    assert 0 < int(keep.sum()) < len(batch)
    out = estimate_advantages(ReinforcePP(), batch, keep)
    alone = ReinforcePP().compute(batch.select(keep.nonzero().flatten()))
    for name in ("advantages", "returns"):
        rows = out[name].rows()
        assert all(torch.all(rows[i] == 0) for i in (~keep).nonzero().flatten().tolist())
        kept = torch.cat([rows[i] for i in keep.nonzero().flatten().tolist()])
        torch.testing.assert_close(kept, alone[name].values)


def _trainer(chat_model):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions

    return FSDPTrainEngine(
        EngineContext(model_path=chat_model, layout=ParallelLayout(), temperature=TEMPERATURE,
                      seed=1),
        FSDPTrainOptions(), OptimSettings(lr=1e-3))


def test_training_on_the_batch_equals_training_on_its_kept_trajectories(chat_model, batch):
    algo = build_algorithm(structure(AlgorithmConfig, {"advantage": "grpo"}))
    keep = apply_failure_policies(batch, "mask", "train")
    for name, column in estimate_advantages(algo.estimator, batch, keep).items():
        batch.set(name, column)
    kept = batch.select(keep.nonzero().flatten())
    kept.fields.pop("train_mask")  # the same samples, never marked
    full, alone = _trainer(chat_model), _trainer(chat_model)
    try:
        before = full.forward_logprobs(batch).values
        batch.set("old_logprobs", full.forward_logprobs(batch))
        kept.set("old_logprobs", alone.forward_logprobs(kept))
        metrics = StepMetrics()
        actor_batch = algo.prepare_actor_batch(batch, metrics)
        assert actor_batch.sample_id.tolist() == kept.sample_id.tolist()
        assert reduce_metrics([metrics.raw()])["actor/masked_fraction"] == pytest.approx(3 / 12)
        full.train_step(actor_batch, algo.policy_loss)
        alone.train_step(algo.prepare_actor_batch(kept, StepMetrics()), algo.policy_loss)
        after_full = full.forward_logprobs(batch).values
        after_alone = alone.forward_logprobs(batch).values
    finally:
        full.shutdown()
        alone.shutdown()
    assert not torch.allclose(after_full, before)  # it trained
    torch.testing.assert_close(after_full, after_alone)  # on the kept trajectories only


def test_a_step_whose_trajectories_are_all_left_out_trains_nothing(chat_model, batch, caplog):
    failing_groups = set(batch.group_id[torch.tensor(_failed(batch))].tolist())
    batch = batch.select([i for i, g in enumerate(batch.group_id.tolist())
                          if g in failing_groups])
    algo = build_algorithm(structure(AlgorithmConfig, {"advantage": "grpo"}))
    keep = apply_failure_policies(batch, "drop_group", "train")
    assert not keep.any()
    for name, column in estimate_advantages(algo.estimator, batch, keep).items():
        batch.set(name, column)
    assert torch.all(batch.ragged("advantages").values == 0)
    trainer = _trainer(chat_model)
    try:
        before = trainer.forward_logprobs(batch).values
        batch.set("old_logprobs", trainer.forward_logprobs(batch))
        actor_batch = algo.prepare_actor_batch(batch, StepMetrics())
        assert len(actor_batch) == 0
        with caplog.at_level(logging.WARNING, logger="peerflow.training"):
            out = trainer.train_step(actor_batch, algo.policy_loss)
        after = trainer.forward_logprobs(batch).values
    finally:
        trainer.shutdown()
    assert "optimizer step is skipped" in caplog.text
    assert math.isfinite(out["loss"]) and out["loss"] == 0.0
    assert trainer.version == 1  # the step counts; the weights did not move
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_the_first_error_of_each_kind_is_logged_once(batch, caplog, monkeypatch):
    from peerflow.algorithms import failed_samples

    monkeypatch.setattr(failed_samples, "_logged_kinds", set())
    with caplog.at_level(logging.WARNING, logger="peerflow.agents"):
        apply_failure_policies(batch, "drop_group", "train")
        apply_failure_policies(batch, "drop_group", "train")
    lines = [r.getMessage() for r in caplog.records if r.name == "peerflow.agents"]
    assert len(lines) == 1
    assert "env_error: flaky-calculator-test.step raised ConnectionError" in lines[0]
    assert "sandbox pool unreachable (connection refused)" in lines[0]
    assert "sample 1, dataset row 1" in lines[0] and "whole group" in lines[0]


def test_an_unknown_policy_is_refused_with_the_choices(batch):
    with pytest.raises(ValueError, match="on_env_error='skip'.*drop_group, mask, train"):
        apply_failure_policies(batch, "skip", "train")
    with pytest.raises(ValueError, match="reward_limits.on_failure='skip'.*drop_group"):
        apply_failure_policies(batch, "train", "skip")
    with pytest.raises(Exception, match="on_env_error"):
        structure(AgentConfig, {"environment": "retry", "on_env_error": "skip"})


def _groups_of(batch, samples: torch.Tensor) -> set[int]:
    return set(batch.group_id[samples].tolist())


@pytest.mark.parametrize("policy", ["drop_group", "mask"])
def test_dynamic_sampling_refills_the_groups_a_failure_policy_leaves_out(batch, policy):
    """The failed trajectories' garbage reward (`CORRUPT`) gives their groups a spread, so
    by rewards alone dynamic sampling would keep them — and the advantage node would then
    leave them out, training a short batch. Judged on the kept samples, they are dropped
    and counted for refilling."""
    failed = torch.tensor(_failed(batch))
    by_rewards = filter_groups(batch, PROMPTS)
    assert _groups_of(batch, failed) <= set(by_rewards.batch.group_id.tolist())
    env_excluded, reward_excluded = failure_exclusions(batch, policy, "train")
    assert not reward_excluded.any()
    result = filter_groups(batch, PROMPTS, excluded=env_excluded)
    kept = set(result.batch.group_id.tolist())
    rewards, groups = batch["reward"].tolist(), batch.group_id.tolist()
    for g in set(groups):  # a group stays when its kept trajectories' rewards differ
        spread = {rewards[i] for i in range(len(batch)) if groups[i] == g
                  and not env_excluded[i]}
        assert (g in kept) == (len(spread) > 1)
    if policy == "drop_group":
        assert not kept & _groups_of(batch, failed)
    assert result.dropped_groups == PROMPTS - len(kept)
    assert result.refill_groups == PROMPTS - len(kept) > 0


@pytest.mark.parametrize("policy", ["train", "mask", "drop_group"])
def test_samples_whose_reward_failed_follow_reward_limits_on_failure(chat_model, batch,
                                                                     policy):
    """A grader that raises for some of the sampled answers (temperature 0.8): `train`
    trains them at `failure_score` (verl's and TRL's behaviour); `mask` and `drop_group`
    leave them out through the environment failures' path; dynamic sampling refills."""
    from transformers import AutoTokenizer

    from peerflow.rewards.scoring import RewardComponent, RewardSet
    from tests.helpers import flaky_grader

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    texts = tokenizer.batch_decode([r.tolist() for r in batch.ragged("response_ids").rows()],
                                   skip_special_tokens=True)
    rewards = RewardSet(components=[RewardComponent(name="grader",
                                                    ref=f"{flaky_grader.__file__}:score")],
                        failure_score=-1.0)
    scores = rewards.score(texts, batch["example"], batch.sample_id.tolist())
    failed = [len(t) % 3 == 0 for t in texts]
    assert scores.failed == failed and 0 < sum(failed) < len(batch)
    assert scores.counts["reward/errors"] == sum(failed)
    batch.set("reward", torch.tensor(scores.total, dtype=torch.float64))
    batch.set(REWARD_FAILED, torch.tensor(failed))
    assert all(r == -1.0 for r, f in zip(scores.total, failed) if f)

    keep = apply_failure_policies(batch, "train", policy)
    groups = batch.group_id.tolist()
    bad = {g for g, f in zip(groups, failed) if f}
    expected = {"train": [True] * len(batch), "mask": [not f for f in failed],
                "drop_group": [g not in bad for g in groups]}[policy]
    assert keep.tolist() == expected
    assert not batch[ENV_EXCLUDED].any()  # the environment's policy left nothing out
    if policy != "train":
        assert batch["train_mask"].tolist() == expected
    excluded = torch.logical_or(*failure_exclusions(batch, "train", policy))
    assert excluded.tolist() == [not k for k in expected]
    refill = filter_groups(batch, PROMPTS, excluded=excluded).refill_groups
    if policy == "drop_group":
        assert refill >= len(bad)

