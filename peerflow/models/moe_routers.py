"""The routers of stock Hugging Face MoE modules, and routing them natively or by force.

`transformers` (≥ 5) gives every MoE family a router module whose `forward(hidden)`
returns `(router_logits, routing_weights, expert_indices)` and an experts module that
applies the chosen experts. Routing replay rebinds the router's `forward` (never the
experts) so that, for the tokens it is told about, the expert *indices* come from outside
while the *weights* are still computed from the live router's logits — the router keeps
its gradient. Each family's weight rule is reproduced bit for bit:

* `softmax_topk` (Qwen2-MoE, Qwen3-MoE, Mixtral): softmax over all experts in float32,
  top-k, renormalised over the k chosen (Mixtral always; Qwen with `norm_topk_prob`),
  cast back to the logits' dtype (Qwen) or kept float32 (Mixtral);
* `topk_softmax` (GPT-OSS): top-k of the (biased) logits, softmax over the k chosen.

With forced indices equal to the native ones (in the same order) the result is the
native forward's, bit for bit: the weights are the same probabilities, gathered instead
of returned by `topk`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import attrs
import torch
import torch.nn.functional as F  # noqa: N812

#: Router classes of `transformers` MoE families, by class name.
ROUTER_CLASSES = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "MixtralTopKRouter",
                  "GptOssTopKRouter")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@attrs.frozen(kw_only=True)
class RouterRule:
    """How a family turns router logits into expert weights."""

    softmax_first: bool
    """Softmax over all experts, then top-k (`False`: top-k of logits, softmax over k)."""
    renormalise: bool
    """Divide the k chosen probabilities by their sum (`softmax_first` only)."""
    cast_back: bool
    """Cast the weights to the logits' dtype (Qwen) instead of keeping float32 (Mixtral)."""


def rule_of(router: torch.nn.Module) -> RouterRule:
    """Returns the weight rule of a router module of `ROUTER_CLASSES`.

    Raises:
        TypeError: the module is not a router this module knows.
    """
    name = type(router).__name__
    if name in ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter"):
        return RouterRule(softmax_first=True, renormalise=bool(router.norm_topk_prob),
                          cast_back=True)
    if name == "MixtralTopKRouter":
        return RouterRule(softmax_first=True, renormalise=True, cast_back=False)
    if name == "GptOssTopKRouter":
        return RouterRule(softmax_first=False, renormalise=False, cast_back=True)
    raise TypeError(f"{name} is not a known MoE router; routing replay knows {ROUTER_CLASSES}.")


def find_routers(model: torch.nn.Module) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """Yields `(layer, qualified name, module)` for every MoE router of `model`, in order.

    The layer is the decoder layer index in the module name (`…layers.{L}.mlp.gate`).
    """
    for name, module in model.named_modules():
        if type(module).__name__ in ROUTER_CLASSES:
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"MoE router {name!r} is not inside a `layers.<index>` module; "
                                 "routing replay cannot tell its layer.")
            yield int(match.group(1)), name, module


def route(router: torch.nn.Module, rule: RouterRule, hidden: torch.Tensor,
          forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor]:
    """Routes `hidden` through `router`, natively or with forced expert indices.

    Args:
        router: A router module (`weight`, optional `bias`, `top_k`).
        rule: Its family's `RouterRule`.
        hidden: `[..., hidden]` token states.
        forced: `[tokens, top_k]` expert ids (int) or `None`; a row with any negative id
            routes natively.

    Returns:
        `(logits [tokens, E], weights [tokens, k], indices [tokens, k], native [tokens, k])`:
        what the router's `forward` returns, plus the indices it would have chosen itself.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    logits = F.linear(hidden, router.weight, getattr(router, "bias", None))
    k = router.top_k
    scores = F.softmax(logits, dtype=torch.float, dim=-1) if rule.softmax_first else logits
    top_values, native = torch.topk(scores, k, dim=-1)
    indices, values = native, top_values
    if forced is not None:
        if forced.shape != native.shape:
            raise ValueError(f"forced routes have shape {tuple(forced.shape)} but the router "
                             f"routes {tuple(native.shape)} (tokens, top_k); the routes do "
                             "not belong to this micro-batch or model.")
        known = (forced >= 0).all(dim=-1, keepdim=True)
        indices = torch.where(known, forced.to(native.dtype), native)
        values = scores.gather(1, indices)
    if rule.softmax_first:
        if rule.renormalise:
            values = values / values.sum(dim=-1, keepdim=True)
        weights = values.to(logits.dtype) if rule.cast_back else values
    else:
        weights = F.softmax(values, dim=1, dtype=values.dtype)
    return logits, weights, indices, native
