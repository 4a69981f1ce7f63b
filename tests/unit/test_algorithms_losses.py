"""Policy losses, value loss, KL and dynamic sampling against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from peerflow.algorithms.aggregation import aggregate
from peerflow.algorithms.dynamic_sampling import filter_groups, take_groups
from peerflow.algorithms.kl import apply_kl_penalty, kl_estimate
from peerflow.algorithms.losses import GSPO, GSPOOptions, PPOClip, PPOClipOptions
from peerflow.algorithms.off_policy import (
    CurrentProximal,
    attach_weights,
    importance_weights,
)
from peerflow.algorithms.regularized import RegularizedLoss
from peerflow.algorithms.value_loss import ClippedValueLoss, ValueLossOptions
from peerflow.batch import Batch, RaggedField
from peerflow.config.schema import OffPolicyConfig


def batch_of(lengths, groups=None, **fields):
    n = len(lengths)
    batch = Batch(sample_id=torch.arange(n),
                  group_id=torch.tensor(groups if groups is not None else list(range(n))),
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("response_ids", RaggedField.from_tensors(
        [torch.zeros(k, dtype=torch.int64) for k in lengths]))
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            batch.set(name, value)
        else:
            flat = torch.tensor(value, dtype=torch.float32)
            batch.set(name, RaggedField.from_tensors(list(torch.split(flat, list(lengths)))))
    return batch


def current(values, lengths):
    flat = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return flat, RaggedField(values=flat, offsets=offsets)


def test_ppo_clip_decoupled_clip_token_mean():
    # ratios 1.5, 0.5, 1.1 against old log-probs 0; advantages 1, -1, 2; clip 0.2 / 0.28
    # token 0: max(-1.5, -1.28) = -1.28 (clipped, no grad)
    # token 1: max(0.5, 0.8) = 0.8 (clipped, no grad)
    # token 2: max(-2.2, -2.2) = -2.2, grad -A r = -2.2
    lengths = [2, 1]
    batch = batch_of(lengths, old_logprobs=[0.0, 0.0, 0.0], advantages=[1.0, -1.0, 2.0])
    flat, lp = current([math.log(1.5), math.log(0.5), math.log(1.1)], lengths)
    loss_fn = PPOClip(PPOClipOptions(clip_low=0.2, clip_high=0.28))
    loss, metrics = loss_fn(lp, batch, global_tokens=3, global_samples=2)
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 2.2) / 3)
    loss.backward()
    assert torch.allclose(flat.grad, torch.tensor([0.0, 0.0, -2.2 / 3], dtype=torch.float64))
    assert metrics["actor/clipfrac"] == pytest.approx(2 / 3)
    assert metrics["actor/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1) / 3)


def test_ppo_clip_dual_clip_caps_negative_advantage_loss():
    # ratio 5, A -1: max(5, 1.2) = 5, dual clip c = 3 caps it at 3
    batch = batch_of([1], old_logprobs=[0.0], advantages=[-1.0])
    _, lp = current([math.log(5.0)], [1])
    loss, metrics = PPOClip(PPOClipOptions(dual_clip=3.0))(lp, batch, global_tokens=1,
                                                           global_samples=1)
    assert loss.item() == pytest.approx(3.0)
    assert metrics["actor/dual_clipfrac"] == 1.0
    with pytest.raises(ValueError, match="dual_clip"):
        PPOClipOptions(dual_clip=0.5)


def test_ppo_clip_truncated_importance_sampling():
    # old - rollout = log 4 -> weight min(4, 2) = 2; ratio 1, A 1: loss -1 * 2
    batch = batch_of([1], old_logprobs=[math.log(0.4)], rollout_logprobs=[math.log(0.1)],
                     advantages=[1.0])
    _, lp = current([math.log(0.4)], [1])
    weights = importance_weights(batch, "tis", cap=2.0)
    assert weights.raw_max == pytest.approx(4.0) and weights.limited_fraction == 1.0
    loss, _ = PPOClip()(lp, attach_weights(batch, weights), global_tokens=1, global_samples=1)
    assert loss.item() == pytest.approx(-2.0)
    no_rollout = batch_of([1], old_logprobs=[0.0], advantages=[1.0])
    with pytest.raises(ValueError, match="rollout_logprobs"):
        importance_weights(no_rollout, "tis", cap=2.0)


def test_ppo_without_old_logprobs_takes_the_detached_current_policy():
    batch = batch_of([1], rollout_logprobs=[math.log(0.5)], advantages=[1.0])
    _, lp = current([math.log(0.55)], [1])  # rollout_logprobs are not the denominator
    loss, _ = PPOClip()(lp, batch, global_tokens=1, global_samples=1)
    assert loss.item() == pytest.approx(-1.0)
    # the fast path's wrapper weighs the token by pi / pi_rollout = 1.1 instead
    tis = CurrentProximal(PPOClip(), OffPolicyConfig(correction="tis", cap=2.0))
    loss, metrics = tis(lp, batch, global_tokens=1, global_samples=1)
    assert loss.item() == pytest.approx(-1.1)
    assert metrics["off_policy/is_weight_max"] == pytest.approx(1.1)
    assert "old_logprobs" not in batch  # the caller's batch is left as it was
    on_policy = batch_of([1], advantages=[3.0])
    flat, lp = current([-2.0], [1])
    loss, _ = PPOClip()(lp, on_policy, global_tokens=1, global_samples=1)
    loss.backward()
    assert loss.item() == pytest.approx(-3.0)
    assert flat.grad.item() == pytest.approx(-3.0)


def test_aggregation_modes():
    per_token = torch.tensor([1.0, 3.0, 4.0])
    lengths = torch.tensor([2, 1])
    kw = dict(global_tokens=6, global_samples=4)
    assert aggregate(per_token, lengths, "token-mean", **kw).item() == pytest.approx(8 / 6)
    assert aggregate(per_token, lengths, "seq-mean-token-mean", **kw).item() == pytest.approx(
        (2 + 4) / 4)
    assert aggregate(per_token, lengths, "seq-mean-token-sum", **kw).item() == pytest.approx(
        (4 + 4) / 4)
    assert aggregate(per_token, lengths, "seq-mean-token-sum-norm", norm_length=8,
                     **kw).item() == pytest.approx(8 / 32)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(per_token, lengths, "seq-mean-token-sum-norm", **kw)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(per_token, lengths, "mean", **kw)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean",
                                         "seq-mean-token-sum-norm"])
def test_micro_batches_sum_to_the_full_batch_gradient(aggregation):
    torch.manual_seed(0)
    lengths = [3, 1, 4, 2]
    total = sum(lengths)
    old = torch.randn(total) * 0.1
    adv = torch.randn(total)
    new = (old + torch.randn(total) * 0.3).double()
    batch = batch_of(lengths, old_logprobs=old.tolist(), advantages=adv.tolist())
    loss_fn = PPOClip(PPOClipOptions(aggregation=aggregation, norm_length=5))
    full = new.clone().requires_grad_(True)
    offsets = torch.tensor([0, 3, 4, 8, 10])
    loss, _ = loss_fn(RaggedField(values=full, offsets=offsets), batch, global_tokens=total,
                      global_samples=4)
    loss.backward()
    pieces = new.clone().requires_grad_(True)
    summed = 0.0
    for idx, (a, b) in (([0, 1], (0, 4)), ([2, 3], (4, 10))):
        part = batch.select(idx)
        lp = RaggedField(values=pieces[a:b], offsets=part.ragged("response_ids").offsets)
        mb_loss, _ = loss_fn(lp, part, global_tokens=total, global_samples=4)
        mb_loss.backward()
        summed += mb_loss.item()
    assert summed == pytest.approx(loss.item())
    assert torch.allclose(pieces.grad, full.grad)


def test_gspo_sequence_ratio_value_and_gradient():
    # log-ratios [log 1.2, 0] -> s = exp(log(1.2) / 2) = sqrt(1.2); A = 1 on both tokens
    # wide clip: per-token loss -s; seq-mean-token-mean over 1 sample -> -s
    # d loss / d logp_t = -s / 2 (token mean inside the sample)
    batch = batch_of([2], old_logprobs=[0.0, 0.0], advantages=[1.0, 1.0])
    flat, lp = current([math.log(1.2), 0.0], [2])
    loss, _ = GSPO(GSPOOptions(clip_low=0.5, clip_high=0.5))(lp, batch, global_tokens=2,
                                                              global_samples=1)
    s = math.sqrt(1.2)
    assert loss.item() == pytest.approx(-s)
    loss.backward()
    assert torch.allclose(flat.grad, torch.tensor([-s / 2, -s / 2], dtype=torch.float64))
    # default GSPO clip (4e-4 above): the ratio is clipped, so no gradient
    flat, lp = current([math.log(1.2), 0.0], [2])
    loss, metrics = GSPO()(lp, batch, global_tokens=2, global_samples=1)
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert metrics["actor/clipfrac"] == 1.0


def test_clipped_value_loss():
    # v = [1, 0], old = [0.5, 0.5], returns = [2, 0], clip 0.2
    # token 0: max((1-2)^2, (0.7-2)^2) = 1.69; token 1: max(0, 0.3^2) = 0.09
    batch = batch_of([2], values=[0.5, 0.5], returns=[2.0, 0.0])
    flat, v = current([1.0, 0.0], [2])
    loss, metrics = ClippedValueLoss(ValueLossOptions(clip=0.2))(v, batch, global_tokens=2,
                                                                 global_samples=1)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09) / 2)
    assert metrics["critic/vf_clipfrac"] == 1.0
    loss.backward()
    assert torch.allclose(flat.grad, torch.zeros(2, dtype=torch.float64))  # both clipped
    loss, _ = ClippedValueLoss(ValueLossOptions(clip=0.0))(v, batch, global_tokens=2,
                                                           global_samples=1)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.0) / 2)


def test_kl_estimators():
    x = math.log(2.0)
    lp, ref = torch.tensor([x]), torch.tensor([0.0])
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(x)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(x * x / 2)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + x)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(lp, ref, "k4")


def test_kl_as_loss_term_adds_coef_times_aggregated_kl():
    # on-policy ppo with A = 0 contributes 0; k3 of log-ratios [log 2, 0] = [log 2 - 0.5, 0]
    batch = batch_of([2], advantages=[0.0, 0.0], ref_logprobs=[0.0, 0.0])
    _, lp = current([math.log(2.0), 0.0], [2])
    loss, _ = RegularizedLoss(PPOClip(), kl_coef=0.1, kl_estimator="k3")(
        lp, batch, global_tokens=2, global_samples=1)
    assert loss.item() == pytest.approx(0.1 * (math.log(2) - 0.5) / 2)


def test_kl_as_reward_penalty():
    # k1 sums: sample 0: log 2 + 0; sample 1: -log 2; coef 0.1
    batch = batch_of([2, 1], reward=torch.tensor([1.0, 0.5]),
                     rollout_logprobs=[math.log(2.0), 0.0, 0.0],
                     ref_logprobs=[0.0, 0.0, math.log(2.0)])
    metrics = apply_kl_penalty(batch, coef=0.1, estimator="k1")
    penalty = 0.1 * math.log(2)
    assert batch["reward"].tolist() == pytest.approx([1 - penalty, 0.5 + penalty])
    assert batch["score"].tolist() == [1.0, 0.5]
    assert metrics["kl/mean"] == pytest.approx(0.0)


def test_dynamic_sampling_drops_all_equal_groups_and_reports_refill():
    batch = batch_of([1] * 6, groups=[0, 0, 1, 1, 2, 2],
                     reward=torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]))
    result = filter_groups(batch, target_groups=3)
    assert result.batch.group_id.tolist() == [1, 1]
    assert result.batch.sample_id.tolist() == [2, 3]
    assert (result.kept_groups, result.dropped_groups, result.refill_groups) == (1, 2, 2)
    assert result.metrics()["dynamic_sampling/dropped_fraction"] == pytest.approx(2 / 3)
    more = batch_of([1] * 4, groups=[5, 5, 6, 6], reward=torch.tensor([0.0, 1.0, 0.2, 0.3]))
    merged = filter_groups(Batch.concat([result.batch, more]), target_groups=2)
    assert merged.refill_groups == 0
    assert take_groups(merged.batch, 2).group_id.tolist() == [1, 1, 5, 5]


def test_kl_reward_penalty_per_token_feeds_token_level_estimators():
    from peerflow.algorithms.advantages import ReinforcePP, ReinforcePPOptions

    # k1 per token: [log 2, 0]; coef 0.5 -> token_rewards [-0.5 log 2, 0]; reward untouched
    batch = batch_of([2], reward=torch.tensor([1.0]), rollout_logprobs=[math.log(2.0), 0.0],
                     ref_logprobs=[0.0, 0.0])
    apply_kl_penalty(batch, coef=0.5, estimator="k1", per_token=True)
    assert batch["reward"].tolist() == [1.0] and "score" not in batch
    assert batch["token_rewards"].values.tolist() == pytest.approx([-0.5 * math.log(2), 0.0])
    returns = ReinforcePP(ReinforcePPOptions()).compute(batch)["returns"].values
    assert returns.tolist() == pytest.approx([1 - 0.5 * math.log(2), 1.0])
