"""Reference ends of a sync, built from plain tensors — independent of any adapter.

`TensorSource` serves full HF tensors as a one-rank trainer would (`weight_sources`,
`materialize`); `TensorSink` receives full HF tensors as a one-rank rollout engine would.
Both satisfy what `peerflow.reshard.sync_weights` calls, so the suite can push weights
into a rollout adapter and pull them out of a train adapter. `reference_logprobs` scores
tokens with a plain `transformers` model holding given tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from peerflow.shard import ShardSpec


class TensorSource:
    """Full HF tensors, served like a one-rank train engine's weight export."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)

    def weight_sources(self) -> list[ShardSpec]:
        """One whole-tensor spec per HF name."""
        return [ShardSpec.of_slice(n, tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
                for n, t in self.tensors.items()]

    def materialize(self, specs: Sequence[ShardSpec]) -> contextlib.AbstractContextManager:
        """Yields the tensors of `specs`."""
        return contextlib.nullcontext([self.tensors[s.local_name] for s in specs])


class TensorSink:
    """Receives full HF tensors like a one-rank rollout engine."""

    def __init__(self, shapes: Mapping[str, Sequence[int]], dtype: str = "float32") -> None:
        self.specs = [ShardSpec.of_slice(n, tuple(s), dtype=dtype) for n, s in shapes.items()]
        self.tensors: dict[str, torch.Tensor] = {}
        self.weight_version = 0
        self._pending = 0

    def weight_targets(self) -> list[ShardSpec]:
        """One whole-tensor spec per HF name."""
        return self.specs

    def begin_weight_update(self, version: int) -> None:
        """Remembers the version to publish."""
        self._pending = version

    def weight_buffers(self, specs: Sequence[ShardSpec]) -> None:
        """No zero-copy path: the sync stages every tensor."""
        return None

    def load_weights(self, items: Sequence[tuple[ShardSpec, torch.Tensor]]) -> None:
        """Keeps a copy of every tensor."""
        for spec, tensor in items:
            self.tensors[spec.local_name] = tensor.clone()

    def finish_weight_update(self) -> None:
        """Publishes the pending version."""
        self.weight_version = self._pending


def load_checkpoint_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """Reads every tensor of a safetensors checkpoint directly from disk (no engine)."""
    from pathlib import Path

    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def reference_logprobs(config: Any, tensors: Mapping[str, torch.Tensor],
                       rows: Sequence[tuple[Sequence[int], Sequence[int]]],
                       temperature: float = 1.0, *, dtype: torch.dtype = torch.float32,
                       attn_implementation: str | None = None) -> list[torch.Tensor]:
    """`log_softmax(logits / temperature)` of each response token under a plain HF model.

    The `RolloutEngine.generate` log-prob contract (temperature 0 counts as 1).

    Args:
        config: `transformers` config of the model.
        tensors: Full HF tensors to load (canonical names; tied head omitted).
        rows: `(prompt_ids, response_ids)` pairs.
        temperature: Sampling temperature the log-probs refer to.
        dtype: Precision the reference computes in (`peerflow.conformance.tolerance`
            scores in float64 and float32 to derive its tolerance).
        attn_implementation: transformers' attention kernel (`eager`, `sdpa`); default
            transformers' choice.

    Returns:
        One float64 tensor `[len(response_ids)]` per row.
    """
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0):
        kwargs["experts_implementation"] = "eager"  # grouped_mm has no float64 kernel
    model = AutoModelForCausalLM.from_config(config, **kwargs).to(dtype).eval()
    missing, _ = model.load_state_dict(module_tensors(model, tensors), strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing:
        raise KeyError(f"reference model lacks tensors {missing[:3]}…")
    return score_rows(model, rows, temperature)


def module_tensors(model: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical HF tensors as `model`'s own parameters: MoE experts packed as it holds them.

    `transformers` ≥ 5 packs a layer's experts (`mlp.experts.gate_up_proj`, `down_proj`);
    canonical tensors name them one by one. The packed tensors are cut from the canonical
    ones by the layout `peerflow.models.hf_layout(…, packed_experts=True)` declares, so the
    reference and the adapters read experts by the same rule. Dense models and families
    without a layout in `peerflow.models` are returned as given.
    """
    from peerflow.conformance.oracle import cut
    from peerflow.errors import ConfigError
    from peerflow.models import ModelShape, hf_layout

    out = dict(tensors)
    try:
        if not ModelShape.from_hf_config(model.config).num_experts:
            return out
    except ConfigError:
        return out
    params = dict(model.named_parameters())
    for spec in hf_layout(model.config, packed_experts=True):
        if spec.local_name in out or spec.local_name not in params:
            continue
        if any(p.name not in tensors for p in spec.pieces):
            continue
        out[spec.local_name] = cut(spec, tensors).view(params[spec.local_name].shape)
        for piece in spec.pieces:
            out.pop(piece.name, None)
    return out


def score_rows(model: Any, rows: Sequence[tuple[Sequence[int], Sequence[int]]],
               temperature: float) -> list[torch.Tensor]:
    """Each row's response-token `log_softmax(logits / T)` under `model`, in float64.

    Temperature 0 counts as 1 (the `RolloutEngine.generate` contract); one forward per
    row, no padding, so nothing but the model's own numerics enters.
    """
    out = []
    with torch.no_grad():
        for prompt, response in rows:
            ids = torch.tensor([list(prompt) + list(response)])
            logits = model(input_ids=ids).logits[0].to(torch.float64)
            logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            start = len(prompt)
            targets = ids[0, start:]
            out.append(logp[start - 1:start - 1 + len(targets)].gather(
                1, targets[:, None])[:, 0])
    return out
