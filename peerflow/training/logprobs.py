"""Token log-probs and entropy of the policy *at the sampling temperature*.

Rollout engines sample token `y` from `softmax(logits / T)`; the policy the trainer
differentiates, the PPO ratio, clipping and the KL must refer to that same distribution,
so every train engine scores a response token as

    log pi_T(y) = log_softmax(logits / T)[y]

over the **full** vocabulary. Top-p / top-k truncation is *not* renormalised: the trainer
scores the tempered, untruncated distribution, as verl (`logits.div_(temperature)` then
`logprobs_from_logits` in `DataParallelPPOActor._forward_micro_batch`) and TRL
(`logits.div_(self.temperature)` then `selective_log_softmax` in
`GRPOTrainer._get_per_token_logps_and_entropies`) do; both pass top-p/top-k to the
generator only. Tokens outside the truncated support are never sampled, so truncation
changes which samples exist, not how each is scored; renormalising would make the score
depend on a support that is not differentiable and moves with the weights. The rollout's
reported log-probs follow the same contract (tempered, untruncated), so on-policy ratios
start at 1 whatever top-p/top-k are.

Logits split over tensor-parallel ranks by vocabulary (Megatron's vocab-parallel output
layer) are scored with the same formula through `VocabShard`; padded vocabulary rows
are masked out first.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

#: Logit given to padded vocabulary rows: exp() underflows to 0 without inf arithmetic.
_MASKED_LOGIT = -1e30


@attrs.frozen(kw_only=True)
class VocabShard:
    """Where this rank's logits sit in a vocabulary split over tensor-parallel ranks."""

    group: Any
    """The tensor-parallel process group that holds the other vocabulary slices."""
    start: int
    """Vocabulary index of this rank's first logit."""
    vocab_size: int
    """The model's real vocabulary size; rows at or past it are padding."""

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with the padded vocabulary rows pushed to a huge negative value."""
        rows = torch.arange(self.start, self.start + logits.shape[-1], device=logits.device)
        padded = rows >= self.vocab_size
        return logits.masked_fill(padded, _MASKED_LOGIT) if bool(padded.any()) else logits


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature` in float32.

    Raises:
        ValueError: `temperature` is not positive (greedy decoding has no log-probs to
            train on).
    """
    if not temperature > 0:
        raise ValueError(
            f"temperature={temperature}: log-probs need a positive sampling temperature; "
            "set rollout.sampling.temperature > 0 for a run that trains."
        )
    return logits.float() / temperature


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                   shard: VocabShard | None = None) -> torch.Tensor:
    """`log_softmax(logits / T)[target]` for every row (differentiable).

    Args:
        logits: `[..., V]` logits (`[..., V / tp]` with `shard`).
        targets: `[...]` token ids (global vocabulary indices).
        temperature: The sampling temperature `T`.
        shard: This rank's vocabulary slice when logits are vocab-parallel.

    Returns:
        `[...]` float32 log-probs.
    """
    scaled = tempered(logits, temperature)
    if shard is None:
        picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(scaled, dim=-1)
    return _VocabParallelLogProb.apply(shard.masked(scaled), targets, shard)


def token_entropy(logits: torch.Tensor, *, temperature: float,
                  shard: VocabShard | None = None) -> torch.Tensor:
    """Entropy of `softmax(logits / T)` for every row.

    Differentiable for full-vocabulary logits; with `shard` (vocab-parallel) it is
    computed without gradient (a metric).

    Returns:
        `[...]` float32 entropies in nats.
    """
    scaled = tempered(logits, temperature)
    if shard is None:
        logp = torch.log_softmax(scaled, dim=-1)
        return -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        scaled = shard.masked(scaled)
        top = scaled.max(-1, keepdim=True).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.group)
        shifted = scaled - top
        weights = shifted.exp()
        sums = torch.stack([weights.sum(-1), (weights * shifted).sum(-1)])
        dist.all_reduce(sums, group=shard.group)
        return sums[0].log() - sums[1] / sums[0]


class _VocabParallelLogProb(torch.autograd.Function):
    """`log_softmax(z)[target]` over vocabulary slices held by the ranks of a group.

    Every rank of the group computes the same value; the backward gives each rank the
    gradient of its own slice, `(onehot - softmax) * grad`, without summing `grad` over
    ranks (each rank's loss is the same replicated value).
    """

    @staticmethod
    def forward(ctx: Any, scaled: torch.Tensor, targets: torch.Tensor,
                shard: VocabShard) -> torch.Tensor:
        top = scaled.max(-1, keepdim=True).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=shard.group)
        shifted = scaled - top
        width = scaled.shape[-1]
        local = (targets >= shard.start) & (targets < shard.start + width)
        index = (targets - shard.start).clamp(0, width - 1).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1) * local
        exp = shifted.exp()
        sums = torch.stack([exp.sum(-1), picked])
        dist.all_reduce(sums, group=shard.group)
        softmax = exp / sums[0].unsqueeze(-1)
        ctx.save_for_backward(softmax, index, local)
        return sums[1] - sums[0].log()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        softmax, index, local = ctx.saved_tensors
        out = -softmax * grad.unsqueeze(-1)
        out.scatter_add_(-1, index, (grad * local).unsqueeze(-1))
        return out, None, None
