"""Policy losses, aggregation, KL estimators and rollout correction against verl's.

Values and gradients (with respect to the current log-probs) in float64, to 1e-6, on
random ragged batches; the losses with verl's global normalisers
(`ActorConfig.global_batch_info`), also split into micro-batches.
"""

from __future__ import annotations

import pytest
import torch

from peerflow.algorithms.aggregation import AGGREGATIONS, aggregate
from peerflow.algorithms.kl import kl_estimate
from peerflow.algorithms.losses import GSPO, GSPOOptions, PPOClip, PPOClipOptions
from peerflow.algorithms.off_policy import attach_weights, importance_weights
from peerflow.batch import RaggedField
from tests.parity.batches import TOLERANCE

NORM = 9  # the constant length of seq-mean-token-sum-norm


def _close(a, b):
    torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=TOLERANCE)


def _inputs(case, spread=0.3):
    old = case.tokens(scale=0.5, shift=-1.0)
    current = old + case.tokens(scale=spread)
    advantages = case.tokens()
    return old, current, advantages


def _ours(loss, case, current, micro_batches=1, **fields):
    """PeerFlow's loss over `micro_batches` micro-batches, and its gradient."""
    leaf = current.clone().requires_grad_(True)
    batch = case.batch(**fields)
    if "rollout_logprobs" in fields:
        batch = attach_weights(batch, importance_weights(batch, "tis", cap=2.0))
    n = len(case.lengths)
    total, tokens = torch.zeros((), dtype=torch.float64), int(case.lengths.sum())
    for part in torch.arange(n).tensor_split(micro_batches):
        micro = batch.select(part.tolist())
        offsets = case.ragged(leaf).offsets
        pieces = [leaf[offsets[i]:offsets[i + 1]] for i in part.tolist()]
        field = RaggedField(values=torch.cat(pieces), offsets=micro.ragged("response_ids").offsets)
        value, _ = loss(field, micro, global_tokens=tokens, global_samples=n)
        total = total + value
    (grad,) = torch.autograd.grad(total, leaf)
    return total, grad


def _theirs(fn, case, old, current, advantages, mode, config, weights=None):
    leaf = case.pad(current).clone().requires_grad_(True)
    value, _ = fn(old_log_prob=case.pad(old), log_prob=leaf, advantages=case.pad(advantages),
                  response_mask=case.mask.to(torch.float64), loss_agg_mode=mode, config=config,
                  rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(value, leaf)
    return value, grad[case.mask]


def _config(actor_config, case, **clip):
    return actor_config(tokens=int(case.lengths.sum()), samples=len(case.lengths), norm=NORM,
                        **clip)


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("clip", [
    {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 0.0},
    {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 0.0},
    {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0},
], ids=["ppo_clip", "clip_higher", "dual_clip"])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_ppo_clip(verl, actor_config, case, mode, clip, micro_batches):
    old, current, advantages = _inputs(case)
    loss = PPOClip(PPOClipOptions(aggregation=mode, norm_length=NORM, **clip))
    ours, ours_grad = _ours(loss, case, current, micro_batches, old_logprobs=old,
                            advantages=advantages)
    config = _config(actor_config, case, clip_low=clip["clip_low"], clip_high=clip["clip_high"],
                     clip_c=clip["dual_clip"] or 1e9)  # verl always dual-clips; 1e9 is off
    theirs, grad = _theirs(verl.compute_policy_loss_vanilla, case, old, current, advantages,
                           mode, config)
    _close(ours, theirs)
    _close(ours_grad, grad)


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo(verl, actor_config, case, mode):
    old, current, advantages = _inputs(case, spread=1e-3)  # GSPO's clip range is 3e-4/4e-4
    loss = GSPO(GSPOOptions(aggregation=mode))
    ours, ours_grad = _ours(loss, case, current, 2, old_logprobs=old, advantages=advantages)
    config = _config(actor_config, case, clip_low=3e-4, clip_high=4e-4)
    theirs, grad = _theirs(verl.compute_policy_loss_gspo, case, old, current, advantages, mode,
                           config)
    _close(ours, theirs)
    _close(ours_grad, grad)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation(verl, case, mode):
    per_token = case.tokens()
    tokens, samples = int(case.lengths.sum()), len(case.lengths)
    ours = aggregate(per_token, case.lengths, mode, global_tokens=tokens,
                     global_samples=samples, norm_length=NORM)
    theirs = verl.agg_loss(case.pad(per_token), case.mask.to(torch.float64), mode,
                           batch_num_tokens=tokens, global_batch_size=samples,
                           loss_scale_factor=NORM)
    _close(ours, theirs)


@pytest.mark.parametrize("estimator,name", [("k1", "k1"), ("k2", "k2"), ("k3", "low_var_kl")])
def test_kl_estimators(verl, case, estimator, name):
    ref = case.tokens(scale=0.5, shift=-1.0)
    logp = (ref + case.tokens(scale=0.4)).requires_grad_(True)
    ours = kl_estimate(logp, ref, estimator)
    (ours_grad,) = torch.autograd.grad(ours.sum(), logp)
    padded = case.pad(logp.detach()).requires_grad_(True)
    theirs = verl.kl_penalty(padded, case.pad(ref), name)
    (grad,) = torch.autograd.grad((theirs * case.mask).sum(), padded)
    _close(ours, theirs[case.mask])
    _close(ours_grad, grad[case.mask])


def test_truncated_importance_weights_in_the_loss(verl, actor_config, case):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    old, current, advantages = _inputs(case)
    rollout = old + case.tokens(scale=0.6)  # a stale behaviour policy
    theirs_weights, _ = compute_rollout_correction_weights(
        case.pad(old - rollout), case.mask.to(torch.float64), rollout_is="token",
        rollout_is_threshold=2.0)
    ours_weights = importance_weights(case.batch(old_logprobs=old, rollout_logprobs=rollout),
                                      "tis", cap=2.0)
    _close(ours_weights.weights, theirs_weights[case.mask])
    loss = PPOClip(PPOClipOptions(aggregation="token-mean"))
    ours, ours_grad = _ours(loss, case, current, 2, old_logprobs=old, rollout_logprobs=rollout,
                            advantages=advantages)
    theirs, grad = _theirs(verl.compute_policy_loss_vanilla, case, old, current, advantages,
                           "token-mean", _config(actor_config, case, clip_c=1e9),
                           weights=theirs_weights)
    _close(ours, theirs)
    _close(ours_grad, grad)


def test_masked_importance_weights(verl, case):
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    old = case.tokens(scale=0.5, shift=-1.0)
    rollout = old + case.tokens(scale=0.8)
    theirs, _ = compute_rollout_correction_weights(
        case.pad(old - rollout), case.mask.to(torch.float64), rollout_is="token",
        rollout_is_threshold="0.5_2.0")  # IcePop: zero outside [0.5, 2]
    ours = importance_weights(case.batch(old_logprobs=old, rollout_logprobs=rollout), "mis",
                              cap=2.0, lower=0.5)
    _close(ours.weights, theirs[case.mask])
