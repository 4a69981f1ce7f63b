"""Every policy loss, regulariser, off-policy correction and metric on the emulated device.

A stale, masked, ragged micro-batch sampled at T = 0.7 crosses to the device the way the
training toolkit moves it (`Batch.to`); each loss and metric must give the CPU's value
and gradient there, without one host/device mix (the emulation raises on any).
"""

from __future__ import annotations

import pytest
import torch

from peerflow.algorithms.aggregation import AGGREGATIONS
from peerflow.algorithms.kl import KL_ESTIMATORS, apply_kl_penalty, kl_loss_metrics
from peerflow.algorithms.losses import GSPO, PPOClip, PPOClipOptions
from peerflow.algorithms.off_policy import (
    CurrentProximal,
    attach_weights,
    importance_weights,
    mismatch_metrics,
)
from peerflow.algorithms.ragged_ops import ragged_like
from peerflow.algorithms.regularized import RegularizedLoss
from peerflow.algorithms.value_loss import ClippedValueLoss
from peerflow.batch import Batch, RaggedField
from peerflow.config.schema import OffPolicyConfig
from peerflow.training.logprobs import token_entropy, token_logprobs

TEMPERATURE = 0.7
LENGTHS = [5, 1, 3, 4, 2, 6]
VOCAB = 11


def host_batch(*, stale: bool = True) -> Batch:
    """Six answers in two groups, two weight versions behind, with a loss mask."""
    gen = torch.Generator().manual_seed(7)
    lengths = torch.tensor(LENGTHS)
    total = int(lengths.sum())
    n = len(LENGTHS)

    def tokens(scale: float = 0.3, shift: float = -1.0) -> RaggedField:
        return ragged_like(torch.randn(total, generator=gen) * scale + shift, lengths)

    batch = Batch(sample_id=torch.arange(n), group_id=torch.tensor([0, 0, 0, 1, 1, 1]),
                  weight_version=torch.full((n,), 3 if stale else 5))
    batch.set("response_ids", ragged_like(torch.randint(0, VOCAB, (total,), generator=gen),
                                          lengths))
    batch.set("loss_mask", ragged_like(torch.rand(total, generator=gen) > 0.2, lengths))
    batch.set("reward", torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0]))
    for name in ("rollout_logprobs", "ref_logprobs", "old_logprobs"):
        batch.set(name, tokens())
    batch.set("advantages", tokens(1.0, 0.0))
    batch.set("values", tokens(0.5, 0.2))
    batch.set("returns", tokens(0.5, 0.4))
    batch.set("entropy", tokens(0.2, 1.5))
    if not stale:
        del batch.fields["old_logprobs"]
    return batch


def _call(loss, batch: Batch, current: torch.Tensor):
    values = RaggedField(values=current.clone().requires_grad_(),
                         offsets=batch.ragged("response_ids").offsets)
    value, metrics = loss(values, batch, global_tokens=20, global_samples=6)
    value.backward()
    return value, metrics, values.values.grad


def _same_on_device(make_loss, device: torch.device, *, stale: bool = True) -> None:
    host = host_batch(stale=stale)
    current = host.ragged("rollout_logprobs").values + 0.05
    if stale:
        weights = importance_weights(host, "tis", 2.0, 0.0)
        host = attach_weights(host, weights)
    on_host = _call(make_loss(), host, current)
    on_device = _call(make_loss(), host.to(device), current.to(device))
    assert on_device[0].device == device and on_device[2].device == device
    torch.testing.assert_close(on_device[0].cpu(), on_host[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(on_device[2].cpu(), on_host[2], rtol=1e-6, atol=1e-7)
    assert on_device[1].keys() == on_host[1].keys()
    for key, value in on_host[1].items():
        assert on_device[1][key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_ppo_clip_on_the_device(device, aggregation):
    _same_on_device(lambda: PPOClip(PPOClipOptions(aggregation=aggregation, dual_clip=3.0,
                                                   clip_high=0.28, norm_length=8)), device)


def test_gspo_on_the_device(device):
    _same_on_device(GSPO, device)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_and_entropy_regularisers_on_the_device(device, estimator):
    _same_on_device(lambda: RegularizedLoss(PPOClip(), kl_coef=0.1, kl_estimator=estimator,
                                            entropy_coef=0.01), device)


@pytest.mark.parametrize("correction", ["tis", "mis", "none"])
def test_on_policy_loss_with_its_off_policy_correction_on_the_device(device, correction):
    """No `old_logprobs`: `CurrentProximal` computes weights and mismatch per micro-batch."""
    config = OffPolicyConfig(correction=correction)
    _same_on_device(lambda: CurrentProximal(PPOClip(), config), device, stale=False)


def test_clipped_value_loss_on_the_device(device):
    _same_on_device(ClippedValueLoss, device)


def test_step_metrics_on_the_device(device):
    """Importance weights, mismatch, KL metrics and the KL reward penalty."""
    host = host_batch()
    on_device = host.to(device)
    weights = importance_weights(on_device, "mis", 2.0, 0.5)
    assert weights.weights.device == device
    assert weights.metrics("mis") == importance_weights(host, "mis", 2.0, 0.5).metrics("mis")
    assert mismatch_metrics(on_device) == mismatch_metrics(host)
    assert kl_loss_metrics(on_device, 0.1, "k3", PPOClip()) == kl_loss_metrics(
        host, 0.1, "k3", PPOClip())
    assert apply_kl_penalty(on_device, 0.1, "k1", per_token=True) == pytest.approx(
        apply_kl_penalty(host, 0.1, "k1", per_token=True))
    torch.testing.assert_close(on_device.ragged("token_rewards").values.cpu(),
                               host.ragged("token_rewards").values)


def test_tempered_logprobs_and_entropy_on_the_device(device):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, VOCAB, generator=gen, requires_grad=True)
    targets = torch.randint(0, VOCAB, (9,), generator=gen)
    on_device = logits.detach().to(device).requires_grad_()
    for x, t in ((logits, targets), (on_device, targets.to(device))):
        (token_logprobs(x, t, temperature=TEMPERATURE).sum()
         + token_entropy(x, temperature=TEMPERATURE).sum()).backward()
    torch.testing.assert_close(on_device.grad.cpu(), logits.grad)
