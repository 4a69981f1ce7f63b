"""Property tests: micro-batching never changes the gradient; group advantages centre."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peerflow.algorithms.advantages import GRPO, RLOO
from peerflow.algorithms.losses import GSPO, GSPOOptions, PPOClip, PPOClipOptions
from peerflow.batch import Batch, RaggedField


def make_batch(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    n, total = len(lengths), sum(lengths)
    batch = Batch(sample_id=torch.arange(n), group_id=torch.arange(n) // 2,
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("response_ids", [torch.zeros(k, dtype=torch.int64) for k in lengths])
    old = torch.randn(total, generator=gen) * 0.1
    batch.set("old_logprobs", RaggedField(values=old, offsets=batch.ragged("response_ids").offsets))
    batch.set("advantages", RaggedField(values=torch.randn(total, generator=gen),
                                        offsets=batch.ragged("response_ids").offsets))
    new = (old + torch.randn(total, generator=gen) * 0.3).double()
    return batch, new


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=2, max_size=8),
       cut=st.integers(1, 7), seed=st.integers(0, 1000),
       aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                    "seq-mean-token-sum-norm"]),
       loss_kind=st.sampled_from(["ppo", "gspo"]))
def test_any_micro_batch_split_gives_the_full_batch_gradient(lengths, cut, seed, aggregation,
                                                              loss_kind):
    cut = 1 + cut % (len(lengths) - 1)
    batch, new = make_batch(lengths, seed)
    if loss_kind == "ppo":
        loss_fn = PPOClip(PPOClipOptions(aggregation=aggregation, norm_length=6, dual_clip=3.0))
    else:
        loss_fn = GSPO(GSPOOptions(aggregation=aggregation, norm_length=6, clip_low=0.2,
                                   clip_high=0.3))
    total, n = sum(lengths), len(lengths)
    full = new.clone().requires_grad_(True)
    loss, _ = loss_fn(RaggedField(values=full, offsets=batch.ragged("response_ids").offsets),
                      batch, global_tokens=total, global_samples=n)
    loss.backward()
    parts = new.clone().requires_grad_(True)
    split = sum(lengths[:cut])
    summed = 0.0
    for idx, (a, b) in ((list(range(cut)), (0, split)), (list(range(cut, n)), (split, total))):
        part = batch.select(idx)
        mb, _ = loss_fn(RaggedField(values=parts[a:b], offsets=part.ragged("response_ids").offsets),
                        part, global_tokens=total, global_samples=n)
        mb.backward()
        summed += mb.item()
    assert abs(summed - loss.item()) < 1e-9
    assert torch.allclose(parts.grad, full.grad, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(rewards=st.lists(st.floats(0, 1), min_size=2, max_size=12), group=st.integers(2, 4))
def test_group_advantages_are_centred(rewards, group):
    n = len(rewards)
    batch = Batch(sample_id=torch.arange(n), group_id=torch.arange(n) // group,
                  weight_version=torch.zeros(n, dtype=torch.int64))
    batch.set("response_ids", [torch.zeros(1, dtype=torch.int64)] * n)
    batch.set("reward", torch.tensor(rewards))
    for estimator in (GRPO(), RLOO()):
        adv = estimator.compute(batch)["advantages"].values
        for g in batch.group_id.unique():
            members = batch.group_id == g
            assert abs(float(adv[members].sum())) < 1e-4
