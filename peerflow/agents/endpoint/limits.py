"""What one policy-endpoint call may ask for: the model's and the run's limits.

A request is validated against them at the edge (the request schemas of
`peerflow.agents.endpoint.protocol` read them from pydantic's validation context), so a
call the engine could not run — a token id outside the vocabulary, a prompt past the
context, more choices than the run samples — is answered 400 naming the field, and never
reaches the batched engine call the whole run shares.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

#: The largest seed a request may send (engines seed a 64-bit generator).
MAX_SEED = 2**63 - 1
#: The largest token count a request may name at all (before the model's context).
MAX_COUNT = 2**31 - 1


@attrs.frozen(kw_only=True)
class RequestLimits:
    """The bounds every call of one run's episodes is checked against."""

    vocab_size: int | None = None
    """Token ids must be below it (the model's embedding rows; `None`: not checked)."""
    context: int | None = None
    """The model's positions: prompt plus answer must fit (`None`: not checked)."""
    max_n: int | None = None
    """Most choices one call may ask for (`rollout.agent.options.max_n`, else
    `rollout.sampling.n`)."""
    max_n_setting: str = ""
    """The setting `max_n` comes from, as a refusal names it (`rollout.sampling.n=8`)."""
    turn_tokens: int | None = None
    """Tokens one turn samples when the call names no `max_tokens` (the run's
    `rollout.sampling.max_tokens`)."""

    def room(self, prompt_tokens: int, max_tokens: int | None) -> str:
        """Why a prompt of `prompt_tokens` cannot be answered, or an empty string."""
        if self.context is None:
            return ""
        answer = min(max_tokens or self.turn_tokens or 1, self.turn_tokens or MAX_COUNT)
        if prompt_tokens + answer <= self.context:
            return ""
        return (f"{prompt_tokens} prompt tokens + {answer} to sample exceed the model's "
                f"context of {self.context} positions; shorten the prompt (or ask for "
                "fewer max_tokens).")


@functools.lru_cache(maxsize=8)
def _model_shape(path: str) -> tuple[int | None, int | None]:
    """`(vocab_size, max_position_embeddings)` of the model at `path` (`None`: unknown)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    except Exception:  # noqa: BLE001 — a tokenizer without a model config: tokenizer only
        return None, None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    positions = getattr(text, "max_position_embeddings", None)
    return (int(vocab) if vocab else None), (int(positions) if positions else None)


def model_limits(tokenizer: Any, sampling: Any, max_n: int) -> RequestLimits:
    """The limits of a run's calls: its model's (found from the tokenizer's path) and its own.

    Args:
        tokenizer: The run's tokenizer (`name_or_path` is the model's directory).
        sampling: The run's `SamplingParams` (`n`, `max_tokens`), or `None`.
        max_n: `rollout.agent.options.max_n` (0: the run's `n`).
    """
    vocab, positions = _model_shape(str(getattr(tokenizer, "name_or_path", "") or ""))
    sizes = [v for v in (vocab, len(tokenizer) if tokenizer is not None else None) if v]
    cap = max_n or getattr(sampling, "n", None) or None
    setting = (f"rollout.agent.options.max_n={max_n}" if max_n else
               f"rollout.sampling.n={cap}")
    return RequestLimits(vocab_size=max(sizes) if sizes else None, context=positions,
                         max_n=cap, max_n_setting=setting,
                         turn_tokens=getattr(sampling, "max_tokens", None))
