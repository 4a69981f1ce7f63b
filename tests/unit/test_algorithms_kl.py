"""KL estimators: what each one's gradient is, as a loss and as a reward, computed exactly.

A categorical policy π_θ = softmax(θ) over a few actions and a fixed reference; the
expectation over sampled tokens is taken exactly (each action weighted by its detached
probability), so the statements in `peerflow.algorithms.kl` are checked without noise.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from peerflow.algorithms.kl import apply_kl_penalty, kl_estimate
from peerflow.algorithms.regularized import RegularizedLoss
from peerflow.algorithms.setup import build_algorithm
from peerflow.batch import Batch, RaggedField
from peerflow.config import AlgorithmConfig, structure

torch.manual_seed(0)
THETA = torch.randn(4, dtype=torch.float64)
REF = torch.log_softmax(torch.randn(4, dtype=torch.float64), 0)


def kl(p_log, q_log):
    return (p_log.exp() * (p_log - q_log)).sum()


def true_gradients():
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    (forward,) = torch.autograd.grad(kl(logp, REF), theta, retain_graph=True)
    (reverse,) = torch.autograd.grad(kl(REF, logp), theta)
    return forward, reverse


def loss_gradient(estimator):
    """∇ E_{a~π}[k(a)] with the sampled actions held fixed (how a loss is differentiated)."""
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    expected = (logp.detach().exp() * kl_estimate(logp, REF, estimator)).sum()
    (grad,) = torch.autograd.grad(expected, theta)
    return grad


def reward_gradient(estimator):
    """Score-function gradient of the reward `-k(a)`: E_{a~π}[∇logπ(a) · (-k(a))]."""
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    penalty = kl_estimate(logp.detach(), REF, estimator)
    surrogate = (logp.detach().exp() * logp * -penalty).sum()
    (grad,) = torch.autograd.grad(surrogate, theta)
    return grad


def cosine(a, b):
    return float(a @ b / (a.norm() * b.norm()))


def test_k1_as_a_loss_has_zero_expected_gradient():
    assert torch.allclose(loss_gradient("k1"), torch.zeros(4, dtype=torch.float64), atol=1e-12)


def test_k2_as_a_loss_is_the_forward_kl_gradient():
    forward, _ = true_gradients()
    assert torch.allclose(loss_gradient("k2"), forward, atol=1e-12)


def test_k3_as_a_loss_is_the_reverse_kl_gradient():
    forward, reverse = true_gradients()
    assert torch.allclose(loss_gradient("k3"), reverse, atol=1e-12)
    assert not torch.allclose(loss_gradient("k3"), forward, atol=1e-3)


def test_k1_as_a_reward_descends_the_forward_kl_and_k3_does_not():
    forward, _ = true_gradients()
    # maximising the reward -k1 moves θ along -∇KL(π || ref)
    assert torch.allclose(reward_gradient("k1"), -forward, atol=1e-12)
    assert not torch.allclose(reward_gradient("k3"), -forward, atol=1e-3)


def test_kl_values_are_unbiased_for_k1_and_k3():
    logp = torch.log_softmax(THETA, 0)
    truth = float(kl(logp, REF))
    for estimator in ("k1", "k3"):
        value = float((logp.exp() * kl_estimate(logp, REF, estimator)).sum())
        assert value == pytest.approx(truth, abs=1e-12)


def test_reward_mode_defaults_to_k1_and_loss_mode_to_k3(plugin_manager):
    reward = build_algorithm(structure(AlgorithmConfig, {"kl": {"coef": 0.1, "mode": "reward"}}),
                             plugin_manager=plugin_manager)
    assert reward.kl_estimator == "k1"
    loss = build_algorithm(structure(AlgorithmConfig, {"kl": {"coef": 0.1, "mode": "loss"}}),
                           plugin_manager=plugin_manager)
    assert loss.kl_estimator == "k3"


def test_k1_as_a_loss_warns(plugin_manager):
    config = structure(AlgorithmConfig, {"kl": {"coef": 0.1, "mode": "loss", "estimator": "k1"}})
    with pytest.warns(UserWarning, match="zero"):
        build_algorithm(config, plugin_manager=plugin_manager)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_algorithm(structure(AlgorithmConfig, {"kl": {"coef": 0.1, "estimator": "k2"}}),
                        plugin_manager=plugin_manager)


def _batch(lengths, reward, **ragged):
    n = len(lengths)
    batch = Batch(sample_id=torch.arange(n), group_id=torch.zeros(n, dtype=torch.int64),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("response_ids", [torch.zeros(k, dtype=torch.int64) for k in lengths])
    batch.set("reward", torch.tensor(reward))
    offsets = batch.ragged("response_ids").offsets
    for name, values in ragged.items():
        batch.set(name, RaggedField(values=torch.tensor(values), offsets=offsets))
    return batch


def test_per_token_kl_reward_reaches_each_token_return(plugin_manager):
    # REINFORCE++ with gamma 1: the return of token t carries only the KL of tokens >= t
    algo = build_algorithm(structure(AlgorithmConfig, {
        "advantage": "reinforce_pp", "kl": {"coef": 0.5, "mode": "reward"}}),
        plugin_manager=plugin_manager)
    batch = _batch([3], [1.0], rollout_logprobs=[0.2, 0.4, 0.8], ref_logprobs=[0.0, 0.0, 0.0])
    algo.kl_penalty(batch)
    assert batch.ragged("token_rewards").values.tolist() == pytest.approx([-0.1, -0.2, -0.4])
    returns = algo.estimator.compute(batch)["returns"].values.tolist()
    assert returns == pytest.approx([1 - 0.7, 1 - 0.6, 1 - 0.4])
    grpo = _batch([3], [1.0], rollout_logprobs=[0.2, 0.4, 0.8], ref_logprobs=[0.0, 0.0, 0.0])
    apply_kl_penalty(grpo, 0.5, "k1")
    assert grpo["reward"].item() == pytest.approx(1 - 0.7)


def test_entropy_bonus_subtracts_the_aggregated_entropy():
    from peerflow.algorithms.losses import PPOClip

    batch = _batch([2, 1], [0.0, 0.0], advantages=[0.0, 0.0, 0.0],
                   entropy=[1.0, 2.0, 4.0])
    current = RaggedField(values=torch.zeros(3, requires_grad=True),
                          offsets=batch.ragged("response_ids").offsets)
    loss, _ = RegularizedLoss(PPOClip(), entropy_coef=0.01)(
        current, batch, global_tokens=3, global_samples=2)
    assert loss.item() == pytest.approx(-0.01 * 7 / 3)
    assert RegularizedLoss(PPOClip(), entropy_coef=0.01).needs_entropy
    del batch.fields["entropy"]
    with pytest.raises(ValueError, match="entropy_coef"):
        RegularizedLoss(PPOClip(), entropy_coef=0.01)(current, batch, global_tokens=3,
                                                      global_samples=2)


def test_kl_loss_metric_does_not_depend_on_the_micro_batch_count(plugin_manager):
    from peerflow.algorithms.kl import kl_loss_metrics
    from peerflow.worker.metrics import StepMetrics, reduce_metrics

    batch = _batch([2, 3, 1], [0.0, 0.0, 0.0], old_logprobs=[0.1, -0.3, 0.2, 0.0, 0.5, -1.0],
                   ref_logprobs=[0.0] * 6)
    whole = kl_loss_metrics(batch, 0.1, "k3")
    halves = StepMetrics()
    for part in (batch.select([0, 1]), batch.select([2])):  # two ranks' shares
        for name, (_, value, weight) in kl_loss_metrics(part, 0.1, "k3").items():
            halves.mean(name, value, weight)
    reduced = reduce_metrics([halves.raw()])
    assert reduced["kl/loss"] == pytest.approx(whole["kl/loss"][1])
    x = torch.tensor([0.1, -0.3, 0.2, 0.0, 0.5, -1.0], dtype=torch.float64)
    assert whole["kl/mean"][1] == pytest.approx(float((torch.exp(-x) - 1 + x).mean()))
    assert math.isfinite(whole["kl/loss"][1])
