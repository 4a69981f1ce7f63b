"""Algorithms are found through the plugin registry and each one learns a toy task."""

from __future__ import annotations

import pytest
import torch

from peerflow.algorithms.dynamic_sampling import filter_groups
from peerflow.algorithms.off_policy import CurrentProximal
from peerflow.algorithms.regularized import RegularizedLoss
from peerflow.algorithms.setup import build_algorithm
from peerflow.batch import Batch, RaggedField
from peerflow.config import AlgorithmConfig, structure
from peerflow.errors import ConfigError, UnknownNameError


def test_registered_names(plugin_manager):
    assert {"grpo", "gae", "rloo", "reinforce_pp"} <= set(
        plugin_manager.registry("advantage_estimator").names())
    assert {"ppo_clip", "gspo"} <= set(plugin_manager.registry("policy_loss").names())
    with pytest.raises(UnknownNameError, match="Did you mean 'grpo'"):
        plugin_manager.registry("advantage_estimator").get("grp")


def test_build_dr_grpo_with_kl_loss(plugin_manager):
    config = structure(AlgorithmConfig, {
        "advantage": "grpo", "loss": "ppo_clip",
        "options": {"grpo": {"unbiased": True}, "ppo_clip": {"clip_high": 0.28}},
        "kl": {"coef": 0.01, "estimator": "k2", "mode": "loss"},
    })
    algo = build_algorithm(config, max_tokens=16, plugin_manager=plugin_manager)
    assert isinstance(algo.policy_loss, CurrentProximal)  # the on-policy fast path
    assert isinstance(algo.policy_loss.loss, RegularizedLoss)
    inner = algo.policy_loss.loss.loss
    assert inner.aggregation == "seq-mean-token-sum-norm"
    assert inner.options.norm_length == 16 and inner.options.clip_high == 0.28
    assert algo.needs_reference and not algo.kl_in_reward and algo.value_loss is None


def test_build_gae_gives_a_value_loss(plugin_manager):
    config = structure(AlgorithmConfig, {"advantage": "gae", "options": {
        "gae": {"lam": 0.9, "value_clip": 0.5}}})
    algo = build_algorithm(config, plugin_manager=plugin_manager)
    assert algo.estimator.options.lam == 0.9
    assert algo.value_loss.options.clip == 0.5
    assert algo.policy_loss.aggregation == "token-mean"


def test_bad_option_names_the_key(plugin_manager):
    config = structure(AlgorithmConfig, {"options": {"ppo_clip": {"clip_hi": 0.3}}})
    with pytest.raises(ConfigError, match=r"algorithm\.options\.ppo_clip\.clip_hi.*clip_high"):
        build_algorithm(config, plugin_manager=plugin_manager)


# A toy "language model": independent logits per position, 4-token vocabulary, answers of
# length 3; reward = fraction of positions equal to the target sequence (partial credit).
TARGET = torch.tensor([2, 0, 3])


def sample(logits, prompts, n, gen):
    probs = torch.softmax(logits, -1)
    tokens = torch.stack([torch.multinomial(probs[t], prompts * n, replacement=True,
                                            generator=gen) for t in range(3)], 1)
    return tokens  # [prompts * n, 3]


def logprobs_of(logits, tokens):
    return torch.log_softmax(logits, -1)[torch.arange(3), tokens].reshape(-1)


def run_toy(plugin_manager, advantage, loss, *, kl_mode=None, dynamic=False, steps=25):
    gen = torch.Generator().manual_seed(0)
    logits = torch.zeros(3, 4, requires_grad=True)
    values = torch.zeros(3, requires_grad=True)
    ref = torch.zeros(3, 4)
    options = {"gspo": {"clip_low": 0.2, "clip_high": 0.2}} if loss == "gspo" else {}
    kl = {"coef": 0.01, "estimator": "k3", "mode": kl_mode} if kl_mode else {}
    algo = build_algorithm(structure(AlgorithmConfig, {
        "advantage": advantage, "loss": loss, "options": options, "kl": kl,
        "dynamic_sampling": dynamic}), max_tokens=3, plugin_manager=plugin_manager)
    opt = torch.optim.Adam([logits, values], lr=0.1)
    prompts, n = 8, 4
    history = []
    for _ in range(steps):
        with torch.no_grad():
            tokens = sample(logits, prompts, n, gen)
            lp = torch.stack([logprobs_of(logits, t) for t in tokens])
            ref_lp = torch.stack([logprobs_of(ref, t) for t in tokens])
        reward = (tokens == TARGET).float().mean(1)
        history.append(reward.mean().item())
        batch = Batch(sample_id=torch.arange(len(tokens)),
                      group_id=torch.arange(prompts).repeat_interleave(n),
                      weight_version=torch.zeros(len(tokens), dtype=torch.int64))
        batch.set("response_ids", list(tokens))
        batch.set("reward", reward)
        batch.set("rollout_logprobs", list(lp))
        batch.set("ref_logprobs", list(ref_lp))
        batch.set("values", list(values.detach().expand(len(tokens), 3)))
        algo.kl_penalty(batch)
        if algo.dynamic_sampling:
            batch = filter_groups(batch).batch
            if len(batch) == 0:
                continue
        for name, field in algo.estimator.compute(batch).items():
            batch.set(name, field)
        offsets = batch.ragged("response_ids").offsets
        tokens_now = torch.stack(batch.ragged("response_ids").rows())
        current = torch.cat([logprobs_of(logits, t) for t in tokens_now])
        total = int(offsets[-1])
        policy, _ = algo.policy_loss(RaggedField(values=current, offsets=offsets), batch,
                                     global_tokens=total, global_samples=len(batch))
        objective = policy
        if algo.value_loss is not None:
            v = values.expand(len(batch), 3).reshape(-1)
            vloss, _ = algo.value_loss(RaggedField(values=v, offsets=offsets), batch,
                                       global_tokens=total, global_samples=len(batch))
            objective = objective + vloss
        opt.zero_grad()
        objective.backward()
        opt.step()
    return sum(history[:3]) / 3, sum(history[-3:]) / 3


@pytest.mark.parametrize("advantage,loss,kl_mode,dynamic", [
    ("grpo", "ppo_clip", None, False),
    ("grpo", "gspo", None, False),
    ("rloo", "ppo_clip", "loss", False),
    ("reinforce_pp", "ppo_clip", "reward", False),
    ("gae", "ppo_clip", None, False),
    ("grpo", "ppo_clip", None, True),
])
def test_each_algorithm_learns_the_toy_task(plugin_manager, advantage, loss, kl_mode, dynamic):
    first, last = run_toy(plugin_manager, advantage, loss, kl_mode=kl_mode, dynamic=dynamic)
    assert last > first + 0.3, (first, last)


def test_model_builder_options_are_checked_before_start(plugin_manager):
    from peerflow.algorithms.setup import check_model_builder
    from peerflow.config import load_config

    good = load_config(None, ["model.builder=reverse-digits",
                              "model.builder_options={hidden_size: 64}"])
    assert check_model_builder(good, plugin_manager) == []
    bad = load_config(None, ["model.builder=reverse-digits",
                             "model.builder_options={hidden: 64}"])
    [problem] = check_model_builder(bad, plugin_manager)
    assert "model.builder_options.hidden: unknown key" in problem
    no_builder = load_config(None, ["model.builder=dataset"])
    assert "has no model builder" in check_model_builder(no_builder, plugin_manager)[0]
    unknown = load_config(None, ["model.builder=revers-digits"])
    assert "(model.builder)" in check_model_builder(unknown, plugin_manager)[0]


def test_algorithm_kl_penalty_picks_per_token_for_token_level_estimators(plugin_manager):
    def batch():
        b = Batch(sample_id=torch.arange(1), group_id=torch.zeros(1, dtype=torch.int64),
                  weight_version=torch.zeros(1, dtype=torch.int64))
        b.set("response_ids", [torch.zeros(2, dtype=torch.int64)])
        b.set("reward", torch.tensor([1.0]))
        b.set("rollout_logprobs", [torch.tensor([0.5, 0.0])])
        b.set("ref_logprobs", [torch.tensor([0.0, 0.0])])
        return b

    kl = {"coef": 0.1, "estimator": "k1", "mode": "reward"}
    for advantage, per_token in (("grpo", False), ("reinforce_pp", True), ("gae", True)):
        algo = build_algorithm(structure(AlgorithmConfig, {"advantage": advantage, "kl": kl}),
                               plugin_manager=plugin_manager)
        b = batch()
        assert algo.kl_penalty(b)["kl/mean"] == pytest.approx(0.25)
        assert ("token_rewards" in b) is per_token
        assert b["reward"].item() == pytest.approx(1.0 if per_token else 0.95)


@pytest.mark.parametrize("overrides", [
    ["algorithm.advantage=grpo"], ["algorithm.advantage=rloo"],
    ["algorithm.advantage=reinforce_pp",
     "algorithm.options={reinforce_pp: {group_baseline: true}}"],
])
def test_group_estimators_refuse_one_answer_per_prompt(plugin_manager, overrides):
    """Issue 33: GRPO with n: 1 trained on zero advantages without a word."""
    from tests.helpers.configs import validation_error

    message = validation_error(plugin_manager, *overrides, "rollout.sampling.n=1")
    assert "rollout.sampling.n=1" in message and "every advantage would be 0" in message


def test_estimators_without_groups_accept_one_answer_per_prompt(plugin_manager):
    from peerflow.config import load_config, validate_config

    validate_config(load_config(None, ["algorithm.advantage=reinforce_pp",
                                       "rollout.sampling.n=1"]), plugin_manager)
