"""`loss_mask`: observation tokens of multi-turn trajectories are trained nowhere.

The central check: every loss, metric and estimator gives on a masked batch exactly what
it gives on the same batch with the observation tokens cut out (`_model_tokens_only`),
masked tokens get zero gradient, and an all-true mask changes nothing at all.
"""

from __future__ import annotations

import pytest
import torch

from peerflow.algorithms.advantages import GRPO, RLOO, ReinforcePP, ReinforcePPOptions
from peerflow.algorithms.aggregation import AGGREGATIONS, aggregate
from peerflow.algorithms.gae import GAE, GAEOptions
from peerflow.algorithms.kl import apply_kl_penalty, kl_loss_metrics
from peerflow.algorithms.losses import GSPO, PPOClip, PPOClipOptions
from peerflow.algorithms.off_policy import (
    CurrentProximal,
    attach_weights,
    importance_weights,
    mismatch_metrics,
)
from peerflow.algorithms.overlong import shape_overlong
from peerflow.algorithms.regularized import RegularizedLoss
from peerflow.algorithms.value_loss import ClippedValueLoss, ValueLossOptions
from peerflow.batch import Batch, RaggedField
from peerflow.config.schema import OffPolicyConfig
from peerflow.training import global_counts

# Ragged trajectories: sample 3 has no model token at all, sample 4 ends on an observation.
LENGTHS = [5, 3, 7, 2, 6, 4]
MASK = [
    [1, 1, 0, 0, 1],
    [1, 1, 1],
    [1, 0, 0, 1, 1, 0, 1],
    [0, 0],
    [1, 1, 0, 0, 1, 0],
    [1, 1, 1, 1],
]
GROUPS = [0, 0, 0, 1, 1, 1]
TOKEN_FIELDS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "advantages", "values",
                "returns", "entropy")


def _ragged(flat: torch.Tensor, lengths=LENGTHS) -> RaggedField:
    return RaggedField.from_tensors(list(torch.split(flat, list(lengths))))


def _batch(mask=MASK, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    n, total = len(LENGTHS), sum(LENGTHS)
    batch = Batch(sample_id=range(n), group_id=GROUPS, weight_version=[0] * n)
    batch.set("prompt_ids", [torch.randint(1, 50, (2 + i,), generator=g) for i in range(n)])
    batch.set("response_ids", _ragged(torch.randint(1, 50, (total,), generator=g)))
    flag = torch.tensor([f for row in mask for f in row], dtype=torch.bool)
    old = -torch.rand(total, generator=g, dtype=torch.float64) * 2
    batch.set("old_logprobs", _ragged(old))
    rollout = old + 0.3 * torch.randn(total, generator=g, dtype=torch.float64)
    batch.set("rollout_logprobs", _ragged(torch.where(flag, rollout, 0.0)))  # 0: convention
    batch.set("ref_logprobs", _ragged(old - 0.2 * torch.rand(total, generator=g,
                                                              dtype=torch.float64)))
    batch.set("advantages", _ragged(torch.randn(total, generator=g, dtype=torch.float64)))
    batch.set("values", _ragged(torch.randn(total, generator=g, dtype=torch.float64)))
    batch.set("returns", _ragged(torch.randn(total, generator=g, dtype=torch.float64)))
    batch.set("entropy", _ragged(torch.rand(total, generator=g, dtype=torch.float64)))
    batch.set("reward", torch.tensor([1.0, 0.0, 0.5, 1.0, 0.25, 0.0], dtype=torch.float64))
    batch.set_objects("finish_reason", ["stop", "length", "stop", "env_error", "max_tokens",
                                        "max_turns"])
    batch.set("loss_mask", _ragged(flag))
    return batch


def _model_tokens_only(batch: Batch) -> Batch:
    """The same trajectories with their observation tokens cut out and no `loss_mask`."""
    mask = batch.ragged("loss_mask").rows()
    out = Batch(sample_id=batch.sample_id, group_id=batch.group_id,
                weight_version=batch.weight_version)
    for name, column in batch.fields.items():
        if name == "loss_mask":
            continue
        if isinstance(column, RaggedField) and name != "prompt_ids":
            out.set(name, RaggedField.from_tensors(
                [row[m] for row, m in zip(column.rows(), mask, strict=True)]))
        elif isinstance(column, RaggedField | torch.Tensor):
            out.set(name, column)
        else:
            out.set_objects(name, column)
    return out


def _logprobs(batch: Batch, seed: int = 1) -> tuple[torch.Tensor, RaggedField]:
    g = torch.Generator().manual_seed(seed)
    old = batch.ragged("old_logprobs")
    flat = (old.values + 0.15 * torch.randn(len(old.values), generator=g,
                                            dtype=torch.float64)).requires_grad_(True)
    return flat, RaggedField(values=flat, offsets=old.offsets)


def _loss(loss_fn, batch: Batch, flat=None, lp=None):
    if lp is None:
        flat, lp = _logprobs(_batch())
    tokens, samples = global_counts(batch, None)
    value, metrics = loss_fn(lp, batch, global_tokens=tokens, global_samples=samples)
    value.backward()
    return value, metrics, flat.grad


def _assert_same_metrics(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and got
    for key, (how, value, weight) in got.items():
        assert (how, weight) == (want[key][0], want[key][2]), key
        assert value == pytest.approx(want[key][1], rel=1e-9), key


def test_trained_lengths_and_global_counts_count_model_tokens():
    batch = _batch()
    assert batch.trained_lengths().tolist() == [3, 3, 4, 0, 3, 4]
    assert global_counts(batch, None) == (17, 5)  # sample 3 has no trained token
    del batch.fields["loss_mask"]
    assert global_counts(batch, None) == (sum(LENGTHS), 6)
    bad = _batch()
    bad.set("loss_mask", RaggedField.from_tensors([torch.ones(k + 1, dtype=torch.bool)
                                                   for k in LENGTHS]))
    with pytest.raises(ValueError, match="'loss_mask' is not aligned.*sample 0 has 6 values"):
        bad.loss_mask()


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_every_aggregation_ignores_masked_tokens(mode):
    batch = _batch()
    mask = batch.loss_mask()
    per_token = torch.randn(len(mask), dtype=torch.float64, requires_grad=True)
    tokens, samples = global_counts(batch, None)
    lengths = batch.lengths("response_ids")
    got = aggregate(per_token, lengths, mode, global_tokens=tokens, global_samples=samples,
                    norm_length=9, mask=mask)
    got.backward()
    assert torch.all(per_token.grad[~mask] == 0) and torch.all(per_token.grad[mask] != 0)
    trained = batch.trained_lengths()
    expected = aggregate(per_token.detach()[mask], trained, mode, global_tokens=tokens,
                         global_samples=samples, norm_length=9)
    torch.testing.assert_close(got.detach(), expected)
    wild = torch.where(mask, per_token.detach(), torch.full_like(per_token, float("inf")))
    assert torch.equal(aggregate(wild, lengths, mode, global_tokens=tokens,
                                 global_samples=samples, norm_length=9, mask=mask),
                       got.detach())
    full = torch.ones_like(mask)
    assert torch.equal(aggregate(per_token, lengths, mode, global_tokens=30,
                                 global_samples=6, norm_length=9, mask=full),
                       aggregate(per_token, lengths, mode, global_tokens=30,
                                 global_samples=6, norm_length=9))


def _losses():
    off_policy = OffPolicyConfig(correction="tis", cap=1.5)
    return {
        "ppo_clip": PPOClip(PPOClipOptions(clip_low=0.2, clip_high=0.28, dual_clip=3.0)),
        "seq_ppo": PPOClip(PPOClipOptions(aggregation="seq-mean-token-mean")),
        "gspo": GSPO(),
        "regularized": RegularizedLoss(
            PPOClip(PPOClipOptions(aggregation="seq-mean-token-sum")), kl_coef=0.1,
            kl_estimator="k3", entropy_coef=0.01),
        "current_proximal": CurrentProximal(PPOClip(), off_policy),
        "value": ClippedValueLoss(ValueLossOptions(clip=0.2, aggregation="token-mean")),
    }


@pytest.mark.parametrize("name", sorted(_losses()))
def test_losses_on_a_masked_batch_are_those_of_its_model_tokens(name):
    loss_fn = _losses()[name]
    batch = _batch()
    if name == "current_proximal":
        del batch.fields["old_logprobs"]  # the on-policy fast path computes the weights
    else:
        weights = importance_weights(batch, "tis", 1.5)
        batch = attach_weights(batch, weights)
    mask = batch.loss_mask()
    flat, lp = _logprobs(_batch())
    value, metrics, grad = _loss(loss_fn, batch, flat, lp)
    assert torch.all(grad[~mask] == 0)
    short = _model_tokens_only(batch)
    s_flat = flat.detach()[mask].clone().requires_grad_(True)
    s_lp = RaggedField(values=s_flat, offsets=short.ragged("response_ids").offsets)
    s_value, s_metrics, s_grad = _loss(loss_fn, short, s_flat, s_lp)
    torch.testing.assert_close(value.detach(), s_value.detach())
    torch.testing.assert_close(grad[mask], s_grad)
    assert metrics.keys() == s_metrics.keys()
    for key in metrics:
        assert metrics[key] == pytest.approx(s_metrics[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("name", sorted(_losses()))
def test_an_all_true_mask_is_exactly_no_mask(name):
    loss_fn = _losses()[name]
    masked = _batch(mask=[[1] * k for k in LENGTHS])
    plain = _batch(mask=[[1] * k for k in LENGTHS])
    del plain.fields["loss_mask"]
    if name == "current_proximal":
        del masked.fields["old_logprobs"], plain.fields["old_logprobs"]
    a_value, a_metrics, a_grad = _loss(loss_fn, masked)
    b_value, b_metrics, b_grad = _loss(loss_fn, plain)
    assert torch.equal(a_value, b_value) and torch.equal(a_grad, b_grad)
    assert a_metrics == b_metrics


def test_kl_penalty_and_kl_metrics_leave_observations_out():
    for per_token in (False, True):
        batch, short = _batch(), _model_tokens_only(_batch())
        got = apply_kl_penalty(batch, 0.05, "k1", per_token=per_token)
        want = apply_kl_penalty(short, 0.05, "k1", per_token=per_token)
        assert got == pytest.approx(want)
        mask = batch.loss_mask()
        assert torch.all(batch.ragged("kl").values[~mask] == 0)
        torch.testing.assert_close(batch["reward"], short["reward"])
        if per_token:
            rewards = batch.ragged("token_rewards").values
            assert torch.all(rewards[~mask] == 0)
            torch.testing.assert_close(rewards[mask], short.ragged("token_rewards").values)
    for mode in AGGREGATIONS:
        loss = PPOClip(PPOClipOptions(aggregation=mode, norm_length=8))
        got = kl_loss_metrics(_batch(), 0.1, "k3", loss)
        want = kl_loss_metrics(_model_tokens_only(_batch()), 0.1, "k3", loss)
        _assert_same_metrics(got, want)


def test_importance_weights_and_mismatch_skip_observations():
    batch = _batch()
    mask = batch.loss_mask()
    for correction in ("tis", "mis"):
        got = importance_weights(batch, correction, 1.2, lower=0.8)
        want = importance_weights(_model_tokens_only(batch), correction, 1.2, lower=0.8)
        assert torch.all(got.weights[~mask] == 1)
        torch.testing.assert_close(got.weights[mask], want.weights)
        assert (got.raw_mean, got.raw_max, got.mean, got.limited_fraction, got.tokens) == \
            pytest.approx((want.raw_mean, want.raw_max, want.mean, want.limited_fraction,
                           want.tokens))
    _assert_same_metrics(mismatch_metrics(batch), mismatch_metrics(_model_tokens_only(batch)))
    # rollout_logprobs are 0 on observations: counted, the mismatch would be huge
    del batch.fields["loss_mask"]
    assert mismatch_metrics(batch)["mismatch/abs_max"][1] > 1.0


@pytest.mark.parametrize("estimator", [
    GRPO(), RLOO(), ReinforcePP(ReinforcePPOptions(gamma=0.9, group_baseline=True)),
    GAE(GAEOptions(gamma=0.95, lam=0.8)), GAE(GAEOptions(gamma=0.9, whiten_advantages=False)),
], ids=["grpo", "rloo", "reinforce_pp", "gae", "gae_raw"])
def test_estimators_run_on_model_tokens(estimator):
    batch = _batch()
    mask = batch.loss_mask()
    turn_rewards = torch.zeros(len(mask), dtype=torch.float64)
    turn_rewards[[1, 12, 18]] = torch.tensor([0.5, -0.25, 0.75], dtype=torch.float64)  # turn ends
    assert bool(mask[[1, 12, 18]].all())
    batch.set("token_rewards", _ragged(turn_rewards))
    short = _model_tokens_only(batch)
    got, want = estimator.compute(batch), estimator.compute(short)
    for name in ("advantages", "returns"):
        field = got[name]
        assert torch.equal(field.offsets, batch.ragged("response_ids").offsets)
        assert torch.all(field.values[~mask] == 0)
        torch.testing.assert_close(field.values[mask], want[name].values)


def test_gae_skips_observation_segments_by_hand():
    # one trajectory: model, model, obs, obs, model; outcome reward 1, turn reward 0.5 on
    # the first turn's last model token. Over the model tokens only (verl's semantics):
    # V = [0.2, 0.4, -, -, 0.6], r = [0, 0.5, -, -, 1]
    gamma, lam = 0.9, 0.5
    batch = Batch(sample_id=[0], group_id=[0], weight_version=[0])
    batch.set("response_ids", [torch.arange(5)])
    batch.set("loss_mask", [torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool)])
    batch.set("values", [torch.tensor([0.2, 0.4, 9.0, -9.0, 0.6], dtype=torch.float64)])
    batch.set("token_rewards", [torch.tensor([0, 0.5, 0, 0, 0], dtype=torch.float64)])
    batch.set("reward", torch.tensor([1.0], dtype=torch.float64))
    out = GAE(GAEOptions(gamma=gamma, lam=lam, whiten_advantages=False)).compute(batch)
    a4 = 1.0 - 0.6
    a1 = 0.5 + gamma * 0.6 - 0.4 + gamma * lam * a4
    a0 = 0.0 + gamma * 0.4 - 0.2 + gamma * lam * a1
    expected = torch.tensor([a0, a1, 0.0, 0.0, a4], dtype=torch.float64)
    torch.testing.assert_close(out["advantages"].values, expected)
    torch.testing.assert_close(out["returns"].values,
                               torch.tensor([a0 + 0.2, a1 + 0.4, 0, 0, a4 + 0.6],
                                            dtype=torch.float64))
    batch.set("token_rewards", [torch.tensor([0, 0, 0.5, 0, 0], dtype=torch.float64)])
    with pytest.raises(ValueError, match="'token_rewards' has reward 0.5 at response token 2"):
        GAE().compute(batch)


def test_overlong_shaping_counts_model_tokens_and_train_mask_keeps_loss_mask():
    batch = _batch()
    shape_overlong(batch, max_tokens=4, buffer=2, penalty=1.0, filter_truncated=True)
    # model tokens [3, 3, 4, 0, 3, 4] against the soft limit 2: penalties 0.5, 0.5, 1, 0, ...
    expected = torch.tensor([0.5, 0.5, 1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    torch.testing.assert_close(batch["score"] - batch["reward"], expected)
    # cut off by a limit: length (one answer), max_tokens / max_turns (agent trajectories)
    assert batch["train_mask"].tolist() == [True, False, True, True, False, False]
    kept = batch.select(batch["train_mask"].nonzero().flatten())
    assert global_counts(kept, None) == (3 + 4 + 0, 2)
