"""Batched next-token sampling: temperature, top-k, top-p, and per-token log-probs.

The log-prob returned for a sampled token is the one `RolloutEngine.generate` promises:
`log_softmax(logits / T)[token]` — the tempered distribution before top-k/top-p
truncation, not renormalised over the kept tokens — which is exactly what train engines
compute at the response tokens, so importance ratios start at 1. Greedy decoding (T = 0)
reports `log_softmax(logits)` (T taken as 1).
"""

from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks logits outside the top-k set and outside the top-p nucleus with `-inf`.

    Args:
        logits: `[batch, vocab]` float logits (already temperature scaled).
        top_k: Keep the k largest (0 disables).
        top_p: Keep the smallest set whose probability mass reaches `top_p` (1.0 disables);
            the token that crosses the threshold is kept, so at least one token survives.

    Returns:
        A new `[batch, vocab]` tensor.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before > top_p, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row and returns it with its log-probability.

    Args:
        logits: `[batch, vocab]` next-token logits (any float dtype).
        temperature: Softmax temperature; 0 picks the argmax (greedy).
        top_k: Top-k cut-off (0 disables).
        top_p: Nucleus mass (1.0 disables).
        generator: Random stream for the multinomial draw.

    Returns:
        `(tokens, logprobs)`, both `[batch]`; logprobs are float32.
    """
    logits = logits.float()
    if temperature <= 0:
        tokens = logits.argmax(dim=-1)
        return tokens, _gather_logprob(logits, tokens)
    tempered = logits / temperature
    probs = filter_logits(tempered, top_k, top_p).softmax(dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, _gather_logprob(tempered, tokens)


def _gather_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
