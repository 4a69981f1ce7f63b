"""Megatron-core `GPTModel` layouts: interleaved `linear_qkv`, fused `linear_fc1`.

Per tp rank and pipeline stage (layers numbered locally, from 0 on every stage):

* `embedding.word_embeddings.weight` (first stage) and `output_layer.weight` (last stage;
  on the last stage of a tied model with pp > 1 it is a replica of the embedding): the
  vocabulary padded to a multiple of `vocab_multiple * tp_size` (Megatron-LM's
  `make_vocab_size_divisible_by`, default 128), split evenly; trailing rows are padding.
* `decoder.layers.N.self_attention.linear_qkv.{weight,bias}`: interleaved per query group
  — for each of this rank's groups g: the group's query heads, then its key head, then its
  value head (`num_heads / num_kv_heads` + 2 heads of `head_dim` rows).
* `…self_attention.linear_proj.weight` and `…mlp.linear_fc2.weight`: row-parallel.
* `…mlp.linear_fc1.weight`: `[gate_r; up_r]` (SwiGLU halves of this rank's channels).
* `…self_attention.q_layernorm` / `k_layernorm` (Qwen3), norms: replicated.
* MoE: `…mlp.router.weight` replicated; experts split over `ep_size` in contiguous blocks,
  each expert's width over `expert_tp_size` (default `tp_size`), named
  `…mlp.experts.local_experts.{i}.linear_fc{1,2}.weight` (SequentialMLP) or, with
  `grouped_experts=True`, `…mlp.experts.linear_fc{1,2}.weight{i}` (TEGroupedMLP).
* `te_names=True` uses Transformer-Engine fused-norm names
  (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) instead of
  `input_layernorm.weight` / `pre_mlp_layernorm.weight`.
"""

from __future__ import annotations

from typing import Any

from peerflow.models.common import (
    ONE_RANK,
    RankCoords,
    Segment,
    rows_of,
    split_even,
    stack,
    whole,
)
from peerflow.models.config import ModelShape
from peerflow.models.hf import col_split
from peerflow.models.vllm import dense_mlp, stage_ends
from peerflow.rounding import pad_to_multiple
from peerflow.shard import ShardSpec

#: Megatron-LM's default `make_vocab_size_divisible_by`.
VOCAB_MULTIPLE = 128

M_EMBED = "embedding.word_embeddings.weight"
M_FINAL_NORM = "decoder.final_layernorm.weight"
M_OUTPUT = "output_layer.weight"


def padded_vocab(vocab: int, tp_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Returns Megatron's padded vocabulary size for `tp_size` ranks."""
    return pad_to_multiple(vocab, multiple * tp_size)


def megatron_layout(config: Any, coords: RankCoords = ONE_RANK, *, grouped_experts: bool = False,
                    te_names: bool = False, vocab_multiple: int = VOCAB_MULTIPLE,
                    dtype: str = "float32") -> list[ShardSpec]:
    """Returns the specs of one Megatron-core `GPTModel` rank's parameters.

    Args:
        config: HF config (object or dict) or `ModelShape`.
        coords: The rank's coordinates; the expert tp size defaults to `tp_size`.
        grouped_experts: TEGroupedMLP names instead of SequentialMLP names.
        te_names: Transformer-Engine fused-norm names (see module docstring).
        vocab_multiple: `make_vocab_size_divisible_by` (the padding multiple per tp rank).
        dtype: torch dtype name of the local tensors.
    """
    shape = ModelShape.from_hf_config(config)
    rep, own, h = coords.tp_replica, coords.own_replica, shape.hidden_size
    tp_rank, tp_size = coords.tp_rank, coords.tp_size
    groups = split_even(shape.num_kv_heads, tp_size, tp_rank, what="query groups (kv heads)")
    mlp = split_even(shape.intermediate_size, tp_size, tp_rank, what="MLP channels")
    first, last = stage_ends(shape, coords, vocab_multiple * tp_size,
                             names=(M_EMBED, M_FINAL_NORM, M_OUTPUT), dtype=dtype)
    specs = first
    for local, layer in enumerate(coords.stage(shape)):
        p, m = f"model.layers.{layer}.", f"decoder.layers.{local}."
        ln1 = ("self_attention.linear_qkv.layer_norm_weight" if te_names
               else "input_layernorm.weight")
        specs.append(whole(f"{p}input_layernorm.weight", (h,), local_name=m + ln1, dtype=dtype,
                           replica=rep))
        specs.extend(_attention(shape, layer, m, groups, dtype=dtype, rep=rep, own=own))
        ln2 = "mlp.linear_fc1.layer_norm_weight" if te_names else "pre_mlp_layernorm.weight"
        specs.append(whole(f"{p}post_attention_layernorm.weight", (h,), dtype=dtype,
                           replica=rep, local_name=m + ln2))
        if shape.is_sparse(layer):
            specs.extend(_moe(shape, layer, m, coords, grouped_experts, dtype))
            continue
        specs.extend(dense_mlp(shape, layer, mlp, fc1=f"{m}mlp.linear_fc1",
                               fc2=f"{m}mlp.linear_fc2", dtype=dtype, rep=rep, own=own))
    specs.extend(last)
    return specs


def _attention(shape: ModelShape, layer: int, m: str, groups: range, *, dtype: str, rep: int,
               own: int) -> list[ShardSpec]:
    """Returns one layer's attention specs: interleaved `linear_qkv`, q/k norms, `linear_proj`."""
    a, hd, h = f"model.layers.{layer}.self_attn.", shape.head_dim, shape.hidden_size
    hpg = shape.heads_per_group
    specs: list[ShardSpec] = []
    for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
        q_dims = (shape.q_rows, h) if kind == "weight" else (shape.q_rows,)
        kv_dims = (shape.kv_rows, h) if kind == "weight" else (shape.kv_rows,)
        segments: list[Segment] = []
        for g in groups:
            segments.append(rows_of(f"{a}q_proj.{kind}", q_dims,
                                    range(g * hpg * hd, (g + 1) * hpg * hd)))
            segments.append(rows_of(f"{a}k_proj.{kind}", kv_dims, range(g * hd, (g + 1) * hd)))
            segments.append(rows_of(f"{a}v_proj.{kind}", kv_dims, range(g * hd, (g + 1) * hd)))
        specs.append(stack(f"{m}self_attention.linear_qkv.{kind}", segments, dtype=dtype,
                           replica=own))
    if shape.qk_norm:
        for hf_norm, m_norm in (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm")):
            specs.append(whole(f"{a}{hf_norm}.weight", (hd,), dtype=dtype, replica=rep,
                               local_name=f"{m}self_attention.{m_norm}.weight"))
    q_cols = range(groups.start * hpg * hd, groups.stop * hpg * hd)
    specs.append(col_split(f"{a}o_proj.weight", (h, shape.q_rows), q_cols, dtype=dtype,
                           replica=own, local_name=f"{m}self_attention.linear_proj.weight"))
    if shape.o_bias:
        specs.append(whole(f"{a}o_proj.bias", (h,), dtype=dtype, replica=rep,
                           local_name=f"{m}self_attention.linear_proj.bias"))
    return specs

def _moe(shape: ModelShape, layer: int, m: str, coords: RankCoords, grouped: bool,
         dtype: str) -> list[ShardSpec]:
    h, i = shape.hidden_size, shape.moe_intermediate_size
    experts, width, expert_rep = coords.expert_split(shape, coords.tp_size)
    specs = [whole(shape.router_name(layer), (shape.num_experts, h), dtype=dtype,
                   replica=coords.tp_replica,
                   local_name=f"{m}mlp.router.weight")]
    for local, e in enumerate(experts):
        gate, up, down = (shape.expert_tensor(layer, e, which) for which in range(3))
        if grouped:
            fc1_name = f"{m}mlp.experts.linear_fc1.weight{local}"
            fc2_name = f"{m}mlp.experts.linear_fc2.weight{local}"
        else:
            fc1_name = f"{m}mlp.experts.local_experts.{local}.linear_fc1.weight"
            fc2_name = f"{m}mlp.experts.local_experts.{local}.linear_fc2.weight"
        fc1 = [rows_of(gate, (i, h), width), rows_of(up, (i, h), width)]
        specs.append(stack(fc1_name, fc1, dtype=dtype, replica=expert_rep))
        specs.append(col_split(down, (h, i), width, dtype=dtype,
                               replica=expert_rep, local_name=fc2_name))
    return specs


def megatron_to_hf(name: str, config: Any, **layout: Any) -> tuple[str, ...]:
    """Returns the HF tensors a Megatron parameter holds pieces of (in local order).

    Args:
        name: Megatron parameter name (local layer numbering).
        config: HF config or `ModelShape`.
        **layout: `megatron_layout` keyword arguments (`coords`, `grouped_experts`,
            `te_names`, …) saying which rank and naming.

    Raises:
        KeyError: no such parameter in that layout.
    """
    for spec in megatron_layout(config, **layout):
        if spec.local_name == name:
            return spec.names
    raise KeyError(f"{name!r} is not a Megatron parameter of this layout ({layout or 'one rank'})")


def hf_to_megatron(name: str, config: Any, **layout: Any) -> tuple[str, ...]:
    """Returns the Megatron parameters (this rank/stage) holding pieces of HF tensor `name`.

    Empty when this rank does not hold any of it (another stage or expert-parallel rank).
    """
    return tuple(s.local_name for s in megatron_layout(config, **layout) if name in s.names)
