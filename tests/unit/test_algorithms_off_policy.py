"""Decoupled PPO's importance weights, the mismatch metrics and the stale-sample guard."""

from __future__ import annotations

import math

import pytest
import torch

from peerflow.algorithms.losses import PPOClip, PPOClipOptions
from peerflow.algorithms.off_policy import attach_weights, importance_weights, mismatch_metrics
from peerflow.algorithms.setup import build_algorithm, check_algorithm
from peerflow.batch import Batch, RaggedField
from peerflow.config import AlgorithmConfig, load_config, structure, validate_config
from peerflow.errors import ConfigError
from peerflow.worker.metrics import StepMetrics, reduce_metrics


def batch_of(lengths, **fields):
    n = len(lengths)
    batch = Batch(sample_id=torch.arange(n), group_id=torch.arange(n),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("response_ids", RaggedField.from_tensors(
        [torch.zeros(k, dtype=torch.int64) for k in lengths]))
    offsets = batch.ragged("response_ids").offsets
    for name, values in fields.items():
        if isinstance(values, torch.Tensor) and values.dim() == 1 and len(values) == n:
            batch.set(name, values)
        else:
            batch.set(name, RaggedField(values=torch.as_tensor(values, dtype=torch.float64),
                                        offsets=offsets))
    return batch


def test_truncated_and_masked_weights():
    # w = [4, 1, 0.25, 2.5]
    log_w = [math.log(4), 0.0, math.log(0.25), math.log(2.5)]
    batch = batch_of([3, 1], old_logprobs=log_w, rollout_logprobs=[0.0] * 4)
    tis = importance_weights(batch, "tis", cap=2.0)
    assert tis.weights.tolist() == pytest.approx([2.0, 1.0, 0.25, 2.0])
    assert tis.limited_fraction == 0.5 and tis.raw_max == pytest.approx(4.0)
    assert tis.raw_mean == pytest.approx((4 + 1 + 0.25 + 2.5) / 4)
    mis = importance_weights(batch, "mis", cap=3.0, lower=0.5)
    assert mis.weights.tolist() == pytest.approx([0.0, 1.0, 0.0, 2.5])
    assert mis.limited_fraction == 0.5 and mis.mean == pytest.approx(3.5 / 4)
    assert importance_weights(batch, "none", cap=2.0) is None
    assert importance_weights(batch_of([1], rollout_logprobs=[0.0]), "tis", cap=2.0) is None
    with pytest.raises(ValueError, match="tis, mis, none"):
        importance_weights(batch, "clip", cap=2.0)


def test_mismatch_metrics_on_the_sampled_tokens():
    rollout = [math.log(0.5), math.log(0.2), math.log(0.9)]
    trainer = [math.log(0.4), math.log(0.2), math.log(0.8)]
    m = mismatch_metrics(batch_of([2, 1], old_logprobs=trainer, rollout_logprobs=rollout))
    deltas = [r - t for r, t in zip(rollout, trainer)]
    assert m["mismatch/abs_mean"] == ("mean", pytest.approx(sum(map(abs, deltas)) / 3), 3)
    assert m["mismatch/abs_max"][1] == pytest.approx(max(map(abs, deltas)))
    k3 = sum(math.exp(-d) - 1 + d for d in deltas) / 3
    assert m["mismatch/kl"][1] == pytest.approx(k3)
    assert m["mismatch/kl_k1"][1] == pytest.approx(sum(deltas) / 3)
    same = mismatch_metrics(batch_of([3], old_logprobs=rollout, rollout_logprobs=rollout))
    assert same["mismatch/kl"][1] == 0.0 and same["mismatch/abs_max"][1] == 0.0


def _expected_loss_gradient(behaviour, proximal_logits, advantages, correction):
    """Gradient of E_{a ~ behaviour}[loss(a)] at θ = proximal, computed exactly.

    Each action is one one-token sample drawn with probability `behaviour[a]`; the
    expectation weights each sample's loss by that probability.
    """
    theta = proximal_logits.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    prox = logp.detach()
    total = torch.zeros((), dtype=torch.float64)
    for a in range(len(behaviour)):
        batch = batch_of([1], old_logprobs=[float(prox[a])],
                         rollout_logprobs=[math.log(float(behaviour[a]))],
                         advantages=[float(advantages[a])])
        weights = importance_weights(batch, correction, cap=100.0)
        if weights is not None:
            batch = attach_weights(batch, weights)
        current = RaggedField(values=logp[a:a + 1], offsets=torch.tensor([0, 1]))
        loss, _ = PPOClip(PPOClipOptions())(current, batch, global_tokens=1, global_samples=1)
        total = total + float(behaviour[a]) * loss
    (grad,) = torch.autograd.grad(total, theta)
    return grad


def test_stale_samples_give_the_on_policy_gradient_only_with_the_correction():
    # the samples come from an older policy (behaviour); the trainer's proximal policy has
    # moved on. The true policy gradient at θ is ∇ E_{a~π_θ}[A(a)].
    torch.manual_seed(0)
    logits = torch.randn(5, dtype=torch.float64)
    behaviour = torch.softmax(logits + 0.7 * torch.randn(5, dtype=torch.float64), 0)
    advantages = torch.randn(5, dtype=torch.float64)
    theta = logits.clone().requires_grad_(True)
    (truth,) = torch.autograd.grad(-(torch.softmax(theta, 0) * advantages).sum(), theta)
    corrected = _expected_loss_gradient(behaviour, logits, advantages, "tis")
    assert torch.allclose(corrected, truth, atol=1e-12)
    uncorrected = _expected_loss_gradient(behaviour, logits, advantages, "none")
    assert (uncorrected - truth).norm() > 0.05 * truth.norm()


def test_stale_configurations_without_a_correction_are_refused(plugin_manager):
    stale_async = ["runtime.mode=async", "runtime.placement=split", "runtime.max_staleness=2"]
    ok = load_config(None, stale_async)
    assert check_algorithm(ok, plugin_manager) == []
    off = load_config(None, [*stale_async, "algorithm.off_policy.correction=none"])
    [problem] = check_algorithm(off, plugin_manager)
    assert "max_staleness=2" in problem and "correction to tis" in problem
    with pytest.raises(ConfigError, match="algorithm.off_policy.correction=none"):
        validate_config(off, plugin_manager)
    every = load_config(None, ["weight_sync.every=3", "algorithm.off_policy.correction=none"])
    assert "weight_sync.every=3" in check_algorithm(every, plugin_manager)[0]
    fresh = load_config(None, ["algorithm.off_policy.correction=none"])
    assert check_algorithm(fresh, plugin_manager) == []


def test_a_loss_that_cannot_apply_weights_is_refused_for_stale_samples(plugin_manager):
    from peerflow.algorithms.base import PolicyLoss

    class PlainPG(PolicyLoss):
        name = "plain_pg"

        def __call__(self, logprobs, batch, *, global_tokens, global_samples):
            raise NotImplementedError

    plugin_manager.registry("policy_loss").register(PlainPG, plugin="test", distribution=None)
    config = load_config(None, ["weight_sync.every=2", "algorithm.loss=plain_pg"])
    [problem] = check_algorithm(config, plugin_manager)
    assert "algorithm.loss='plain_pg' does not apply importance weights" in problem


def test_prepare_actor_batch_masks_weights_and_records_step_metrics(plugin_manager):
    algo = build_algorithm(structure(AlgorithmConfig, {"kl": {"coef": 0.1}}),
                           plugin_manager=plugin_manager)
    batch = batch_of([2, 1, 1], old_logprobs=[math.log(3), 0.0, 0.0, 0.0],
                     rollout_logprobs=[0.0, 0.0, 0.0, math.log(2)],
                     ref_logprobs=[0.0, 0.0, 0.0, 0.0],
                     train_mask=torch.tensor([True, True, False]))
    metrics = StepMetrics()
    out = algo.prepare_actor_batch(batch, metrics)
    assert out.sample_id.tolist() == [0, 1]
    assert out.ragged("is_weights").values.tolist() == pytest.approx([2.0, 1.0, 1.0])
    m = reduce_metrics([metrics.raw()])
    assert m["off_policy/is_weight_max"] == pytest.approx(3.0)
    assert m["off_policy/truncated_fraction"] == pytest.approx(1 / 3)
    assert m["mismatch/abs_max"] == pytest.approx(math.log(3))
    assert m["actor/masked_fraction"] == pytest.approx(1 / 3)
    # KL of the policy before the update (old_logprobs) to the reference, token-mean, k3
    k3 = (math.exp(-math.log(3)) - 1 + math.log(3)) / 3
    assert m["kl/mean"] == pytest.approx(k3)
    assert m["kl/loss"] == pytest.approx(0.1 * k3)
