"""Copies of the built-in adapters with one planted fault each: the suite must catch them.

`HFFused` is the `hf` engine storing vLLM's tp-1 layout (fused `qkv_proj` and
`gate_up_proj`, vocabulary padded to 64 rows): its modules' parameters are views into
those fused tensors, so a wrong declared piece order loads and reads back bit-exact —
the self-consistent layout bug only behaviour reveals. Every other class plants one
fault authors make; `EXPECTED` lists what the suite must say about each.
"""

from __future__ import annotations

import attrs
import torch

from peerflow.adapters.hf.engine import HFRolloutEngine
from peerflow.adapters.vllm.engine import VLLMRolloutEngine
from peerflow.adapters.vllm.options import VLLMRolloutOptions
from peerflow.engines import EngineContext
from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout
from peerflow.models import hf_layout, vllm_layout
from peerflow.shard import Box, ShardPiece


class HFWithLayout(HFRolloutEngine):
    """`hf` with its declared layout (the base of the load-path mutants)."""

    @classmethod
    def shard_layout(cls, hf_config, layout, rank, dtype="float32"):
        return hf_layout(hf_config, dtype=dtype)

    @classmethod
    def conformance_layouts(cls):
        return [ParallelLayout()]


class HFFused(HFWithLayout):
    """`hf` whose parameters live in vLLM-style fused tensors (a correct adapter)."""

    @classmethod
    def storage_layout(cls, hf_config, dtype="float32"):
        """What the engine really stores (its modules are views into these tensors)."""
        return vllm_layout(hf_config, dtype=dtype)

    @classmethod
    def shard_layout(cls, hf_config, layout, rank, dtype="float32"):
        if layout.world_size > 1:
            raise ConfigError("HFFused runs on one rank only")
        return cls.storage_layout(hf_config, dtype)

    def __init__(self, context, options=None):
        super().__init__(context, options)
        named = dict(self.model.named_parameters(remove_duplicate=False))
        aliases: dict[int, list[str]] = {}
        for name, param in named.items():
            aliases.setdefault(id(param), []).append(name)
        self.fused: dict[str, torch.Tensor] = {}
        for spec in self.storage_layout(self.model.config, context.dtype):
            local = torch.zeros(spec.local_shape, dtype=getattr(torch, spec.dtype))
            for piece in spec.pieces:
                view = local[piece.local_box.slices()]
                view.copy_(named[piece.name].data[piece.global_box.slices()])
                param = torch.nn.Parameter(view, requires_grad=False)
                for alias in aliases[id(named[piece.name])]:
                    module, _, attr = alias.rpartition(".")
                    setattr(self.model.get_submodule(module), attr, param)
            self.fused[spec.local_name] = local

    def weight_targets(self):
        return self.shard_layout(self.model.config, self.context.layout, self.context.rank,
                                 self.context.dtype)

    def weight_buffers(self, specs):
        return [self.fused[s.local_name] for s in specs]

    def load_weights(self, items):
        for spec, tensor in items:
            target = self.fused[spec.local_name]
            if tensor.data_ptr() != target.data_ptr():
                target.copy_(tensor)

    @classmethod
    def conformance_read_weights(cls, engine):
        return dict(engine.fused)


def _reordered(specs, fused: str, order: tuple[str, ...]):
    """Declares the row-stacked pieces of every `fused` tensor in `order` (by HF name)."""
    out = []
    for spec in specs:
        if spec.local_name.endswith(fused):
            by_kind = {p.name.rsplit(".", 2)[-2]: p for p in spec.pieces}
            row, pieces = 0, []
            for kind in order:
                p = by_kind[kind]
                pieces.append(attrs.evolve(p, local_box=Box(
                    offsets=(row,) + p.local_box.offsets[1:], sizes=p.local_box.sizes)))
                row += p.local_box.sizes[0]
            spec = attrs.evolve(spec, pieces=tuple(pieces))
        out.append(spec)
    return out


class _Swapped(HFFused):
    """Declares the pieces of every `FUSED` tensor in `ORDER`, not the order it stores."""

    FUSED: str
    ORDER: tuple[str, ...]

    @classmethod
    def shard_layout(cls, hf_config, layout, rank, dtype="float32"):
        return _reordered(super().shard_layout(hf_config, layout, rank, dtype), cls.FUSED,
                          cls.ORDER)


class QKSwapped(_Swapped):
    """Declares `[k; q; v]` for the `[q; k; v]` it stores."""

    FUSED, ORDER = "qkv_proj.weight", ("k_proj", "q_proj", "v_proj")


class KVSwapped(_Swapped):
    """Declares `[q; v; k]` for the `[q; k; v]` it stores."""

    FUSED, ORDER = "qkv_proj.weight", ("q_proj", "v_proj", "k_proj")


class GateUpSwapped(_Swapped):
    """Declares `[up; gate]` for the `[gate; up]` it stores."""

    FUSED, ORDER = "gate_up_proj.weight", ("up_proj", "gate_proj")


class VocabPadOffByOne(HFFused):
    """Declares the vocabulary padding one row too early."""

    @classmethod
    def shard_layout(cls, hf_config, layout, rank, dtype="float32"):
        out = []
        for spec in super().shard_layout(hf_config, layout, rank, dtype):
            if spec.padding:
                (piece,) = spec.pieces
                rows, cols = piece.local_box.sizes[0] - 1, piece.local_box.sizes[1]
                pad = spec.padding[0]
                spec = attrs.evolve(spec, pieces=(ShardPiece(
                    name=piece.name, global_shape=piece.global_shape,
                    global_box=Box(offsets=(0, 0), sizes=(rows, cols)),
                    local_box=Box(offsets=(0, 0), sizes=(rows, cols))),), padding=(Box(
                        offsets=(pad.offsets[0] - 1, 0), sizes=(pad.sizes[0] + 1, cols)),))
            out.append(spec)
        return out


class LayerSkipped(HFWithLayout):
    """`load_weights` ignores layer 1 (an off-by-one in a layer loop)."""

    def weight_buffers(self, specs):
        return None

    def load_weights(self, items):
        super().load_weights([(s, t) for s, t in items if ".layers.1." not in s.local_name])


class DroppedBucket(HFWithLayout):
    """`load_weights` keeps only the last bucket of a sync (assigns instead of appends)."""

    def weight_buffers(self, specs):
        return None

    def begin_weight_update(self, version):
        super().begin_weight_update(version)
        self.calls = 0

    def load_weights(self, items):
        self.calls += 1
        if self.calls != 2:
            super().load_weights(items)


class StaleVersion(HFWithLayout):
    """Overrides `finish_weight_update` to reset a cache and forgets `super()`."""

    def finish_weight_update(self):
        self.cache_cleared = True


class RebindingLoad(HFWithLayout):
    """`load_weights` rebinds each parameter to the tensor it is given."""

    def load_weights(self, items):
        for spec, tensor in items:
            self._param(spec).data = tensor


class UntemperedLogprobs(HFWithLayout):
    """Returns `log_softmax(logits)` (temperature 1) whatever the sampling temperature."""

    def generate(self, requests, sampling):
        results = super().generate(requests, sampling)
        prompts = {r.request_id: r.prompt_ids for r in requests}
        out = []
        for r in results:
            ids = torch.tensor([list(prompts[r.request_id]) + list(r.token_ids)])
            start = len(prompts[r.request_id])
            with torch.no_grad():
                logits = self.model(input_ids=ids).logits[0, start - 1:-1].float()
            logp = logits.log_softmax(-1).gather(1, ids[0, start:, None])[:, 0]
            out.append(attrs.evolve(r, logprobs=logp.tolist()))
        return out


class VLLMUntempered(VLLMRolloutEngine):
    """vLLM run with `logprobs_mode="raw_logprobs"`: log-probs taken before temperature."""

    @classmethod
    def conformance_engine(cls, model_path, *, device="cpu"):
        context = EngineContext(model_path=model_path, layout=ParallelLayout(), rank=0,
                                dtype="float32", device=device)
        return cls(context, VLLMRolloutOptions(engine_args={"logprobs_mode": "raw_logprobs"}))


#: mutant → strings its failure report must contain (parameter or method, and the fix).
EXPECTED = {
    "QKSwapped": ["layer 0 attention", "the engine reads local tensor "
                  "'model.layers.0.self_attn.qkv_proj.weight' as rows [0:128] = "
                  "model.layers.0.self_attn.q_proj.weight", "Fix the piece order"],
    "KVSwapped": ["layer 0 attention", "rows [128:192] = model.layers.0.self_attn.k_proj.weight",
                  "Fix the piece order"],
    "GateUpSwapped": ["layer 0 MLP", "rows [0:256] = model.layers.0.mlp.gate_proj.weight",
                      "Fix the piece order"],
    "VocabPadOffByOne": ["model.embed_tokens.weight: 16 of 1120 elements are held by no shard",
                         "extend a piece over them"],
    "LayerSkipped": ["not written by the sync (still holding their old values): "
                     "model.layers.1.input_layernorm.weight",
                     "a skipped layer or a dropped bucket"],
    "DroppedBucket": ["not written by the sync", "DroppedBucket.load_weights must copy every"],
    "StaleVersion": ["StaleVersion.finish_weight_update overrides it without calling super()",
                     "super().finish_weight_update"],
    "RebindingLoad": ["the engine's outputs changed when the caller overwrote",
                      "RebindingLoad.load_weights keeps the tensors", "param.copy_(tensor)"],
    "UntemperedLogprobs": ["they equal the untempered log_softmax(logits)",
                           "UntemperedLogprobs.generate must return", "log_softmax(logits / T)"],
}

#: vLLM mutants (run when vllm is installed; one engine each).
EXPECTED_VLLM = {
    "VLLMUntempered": ["they equal the untempered log_softmax(logits)",
                       "VLLMUntempered.generate must return",
                       "logprobs_mode='processed_logprobs'"],
}


class HFMoE(HFRolloutEngine):
    """`hf` on one rank whose `weight_targets()` is its declared `shard_layout` (MoE base)."""

    @classmethod
    def conformance_layouts(cls):
        return [ParallelLayout()]

    def weight_targets(self):
        return self.shard_layout(self.model.config, self.context.layout, self.context.rank,
                                 self.context.dtype)


def _renamed(specs, local_name: str, swap: dict[str, str]):
    """`specs` with the pieces of `local_name` declaring each other's HF tensors (`swap`)."""
    out = []
    for spec in specs:
        if spec.local_name == local_name:
            spec = attrs.evolve(spec, pieces=tuple(
                attrs.evolve(p, name=swap.get(p.name, p.name)) for p in spec.pieces))
        out.append(spec)
    return out


def _both_ways(pairs: dict[str, str]) -> dict[str, str]:
    return {**pairs, **{b: a for a, b in pairs.items()}}


class ExpertsPermuted(HFMoE):
    """Declares layer 0's experts 0 and 1 in each other's place (packed gate_up and down)."""

    @classmethod
    def shard_layout(cls, hf_config, layout, rank, dtype="float32"):
        specs = super().shard_layout(hf_config, layout, rank, dtype)
        x = "model.layers.0.mlp.experts."
        swap = _both_ways({f"{x}0.{p}.weight": f"{x}1.{p}.weight"
                           for p in ("gate_proj", "up_proj", "down_proj")})
        for tensor in ("gate_up_proj", "down_proj"):
            specs = _renamed(specs, f"{x}{tensor}", swap)
        return specs


class ExpertGateUpSwapped(HFMoE):
    """Declares expert 1 of layer 0 as `[up; gate]` for the `[gate; up]` it stores."""

    @classmethod
    def shard_layout(cls, hf_config, layout, rank, dtype="float32"):
        x = "model.layers.0.mlp.experts."
        return _renamed(super().shard_layout(hf_config, layout, rank, dtype),
                        f"{x}gate_up_proj", _both_ways({f"{x}1.gate_proj.weight":
                                                        f"{x}1.up_proj.weight"}))


#: MoE mutants (layer 3 on the `qwen3moe-untied` engine model) → what their report says.
EXPECTED_MOE = {
    "ExpertsPermuted": ["layer 0 MLP", "the engine computes expert 0", "with expert 1's "
                        "tensors", "'model.layers.0.mlp.experts.gate_up_proj'",
                        "Fix the expert order"],
    "ExpertGateUpSwapped": ["layer 0 MLP", "the engine uses the data of "
                            "model.layers.0.mlp.experts.1.gate_proj.weight as "
                            "model.layers.0.mlp.experts.1.up_proj.weight"],
}
