"""The fsdp engine's shard layout as a pure function of an HF config and a mesh.

What `FSDPTrainEngine.weight_sources()` returns on a rank, computed without building the
engine (the conformance suite's `shard_layout` hook, and the planner's dry runs):

1. every canonical HF tensor, whole (`peerflow.models.hf_layout`; tied embeddings once);
2. with tp > 1, the engine's tensor-parallel plan (`model.TP_PLAN`): column-parallel
   q/k/v/gate/up (weights and biases) keep a `torch.chunk` of their rows, row-parallel
   o/down weights a chunk of their columns; everything else is replicated over tp;
3. FSDP2 then keeps a `torch.chunk` of each local tensor's rows on every dp-rank (an
   empty chunk is a spec with no pieces).

A tensor replicated over tp is held by every tp peer: its replica index is the tp rank.
"""

from __future__ import annotations

from typing import Any

from peerflow.adapters.fsdp.model import TP_PLAN
from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout
from peerflow.shard import Box, ShardSpec

#: Model families whose transformers modules map onto canonical HF tensors (Qwen3-MoE's and
#: Mixtral's packed experts by their 2-D views, experts one by one; GPT-OSS's packed experts
#: as its checkpoints hold them: `peerflow.models.packed_experts`).
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")


def _chunk(total: int, parts: int, index: int) -> range:
    """Rows `torch.chunk(total, parts)[index]` holds (possibly empty)."""
    size = -(-total // parts)
    start = min(total, index * size)
    return range(start, min(total, start + size))


def _split(spec: ShardSpec, dim: int, span: range, replica: int) -> ShardSpec:
    """The part of a whole-tensor spec that keeps indices `span` along `dim`."""
    (piece,) = spec.pieces
    offsets = [0] * len(spec.local_shape)
    sizes = list(spec.local_shape)
    offsets[dim], sizes[dim] = span.start, len(span)
    return ShardSpec.of_slice(piece.name, piece.global_shape, Box(offsets=offsets, sizes=sizes),
                              local_name=spec.local_name, dtype=spec.dtype, replica=replica)


def _dp_rows(spec: ShardSpec, dp: int, dp_rank: int, unit: int = 1) -> ShardSpec:
    """FSDP2's dim-0 shard of `spec` on dp rank `dp_rank`.

    A `torch.chunk` of `local_shape[0] // unit` items: rows, or the experts of a packed
    expert tensor (`unit` rows each).
    """
    from peerflow.models import restrict_rows

    if dp == 1:
        return spec
    items = _chunk(spec.local_shape[0] // unit, dp, dp_rank)
    return restrict_rows(spec, range(items.start * unit, items.stop * unit))


def _tp_style(name: str) -> str | None:
    module, _, kind = name.rpartition(".")
    for suffix, style in TP_PLAN.items():
        if module.endswith("." + suffix):
            return style if style == "colwise" or kind == "weight" else None
    return None


def fsdp_shard_layout(
    config: Any, layout: ParallelLayout, rank: int, dtype: str = "float32"
) -> list[ShardSpec]:
    """Returns the specs `weight_sources()` gives on global rank `rank` of `layout`.

    Raises:
        ConfigError: The layout has pp/ep/cp > 1, tp does not divide the heads or MLP
            width, or the model family is not one of `FAMILIES`.
    """
    from peerflow.models import ModelShape, hf_layout

    shape = ModelShape.from_hf_config(config)
    if shape.family not in FAMILIES:
        raise ConfigError(
            f"the fsdp engine maps HF tensors one to one for {FAMILIES}; model family "
            f"{shape.family!r} (packed MoE experts) is not supported by its weight export."
        )
    if layout.pp > 1 or layout.ep > 1 or layout.cp > 1:
        raise ConfigError(
            f"the fsdp engine supports dp and tp only; layout {layout.describe()} is refused."
        )
    if shape.num_experts and layout.tp > 1:
        raise ConfigError(
            f"the fsdp engine's tensor parallelism does not split MoE experts; layout "
            f"{layout.describe()} is refused for {shape.family} (set trainer.layout.tp: 1)."
        )
    coord = layout.coord(rank)
    tp = layout.tp
    for what, count in (("attention heads", shape.num_heads),
                        ("key/value heads", shape.num_kv_heads),
                        ("intermediate_size", shape.intermediate_size)):
        if count % tp:
            raise ConfigError(
                f"trainer.layout.tp={tp} does not divide the model's {count} {what}; choose "
                "a tp that divides it."
            )
    specs = []
    for spec in hf_layout(config, dtype=dtype, packed_experts=bool(shape.num_experts)):
        style = _tp_style(spec.local_name) if tp > 1 else None
        if style == "colwise":
            spec = _split(spec, 0, _chunk(spec.local_shape[0], tp, coord.tp), 0)
        elif style == "rowwise":
            spec = _split(spec, 1, _chunk(spec.local_shape[1], tp, coord.tp), 0)
        elif tp > 1:
            spec = _split(spec, 0, range(spec.local_shape[0]), coord.tp)
        packed = shape.num_experts and spec.local_name.endswith(("experts.gate_up_proj",
                                                                 "experts.down_proj"))
        unit = spec.local_shape[0] // shape.num_experts if packed else 1
        specs.append(_dp_rows(spec, layout.dp, coord.dp, unit))
    return specs
