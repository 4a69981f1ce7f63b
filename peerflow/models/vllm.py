"""vLLM (and SGLang) layouts: stacked `qkv_proj` / `gate_up_proj`, padded vocab shards.

vLLM's Llama/Qwen2/Qwen3/Qwen3-MoE modules (and SGLang's, which use the same names)
hold per tp rank:

* `model.embed_tokens.weight`, `lm_head.weight`: `VocabParallelEmbedding` /
  `ParallelLMHead` — the vocabulary is padded to a multiple of `vocab_multiple` (64 in
  vLLM), then split evenly; rows past the real vocabulary are padding.
* `self_attn.qkv_proj.{weight,bias}`: `[q_r; k_r; v_r]` — this rank's query heads, then
  its key/value heads. With `tp_size > num_kv_heads` each kv head is replicated on
  `tp_size // num_kv_heads` consecutive ranks (`QKVParallelLinear`).
* `self_attn.o_proj.weight`, `mlp.down_proj.weight`: row-parallel (columns split).
* `mlp.gate_up_proj.weight`: `[gate_r; up_r]`.
* MoE (`FusedMoE`): router `mlp.gate.weight` replicated;
  `mlp.experts.routed_experts.w13_weight` `[E_local, 2*I_r, H]` (per expert
  `[gate_r; up_r]`) and `mlp.experts.routed_experts.w2_weight` `[E_local, H, I_r]`
  (vLLM 0.32 holds them in `FusedMoE`'s `routed_experts` submodule; SGLang directly under
  `mlp.experts.`), described by their 2-D views `[E_local*2*I_r, H]` and
  `[E_local*H, I_r]`. Experts split over `ep_size` ranks (contiguous blocks); each
  expert's width splits over `expert_tp_size` (default: `tp_size` without ep, else 1).
* Norms, q/k norms and row-parallel biases are replicated.

With tied embeddings and one stage there is no `lm_head.weight` tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs

from peerflow.errors import ConfigError
from peerflow.models.common import (
    ONE_RANK,
    RankCoords,
    Segment,
    replica_index,
    rows_of,
    split_even,
    stack,
    whole,
)
from peerflow.models.config import ModelShape
from peerflow.models.hf import EMBED, FINAL_NORM, LM_HEAD, col_split
from peerflow.rounding import pad_to_multiple
from peerflow.shard import ShardSpec

#: vLLM's `DEFAULT_VOCAB_PADDING_SIZE`.
VOCAB_MULTIPLE = 64

#: (fused name, HF name, vLLM shard id): vLLM's `stacked_params_mapping`.
STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

#: Where vLLM (0.32) keeps FusedMoE's expert tensors, under `mlp.`.
VLLM_EXPERTS = "experts.routed_experts."
#: Where SGLang keeps them.
SGLANG_EXPERTS = "experts."

#: HF expert projection (Qwen-style and Mixtral names) → (vLLM FusedMoE parameter, shard id).
EXPERT_PARAMS = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"),
                 "down_proj": ("w2_weight", "w2"), "w1": ("w13_weight", "w1"),
                 "w3": ("w13_weight", "w3"), "w2": ("w2_weight", "w2")}

#: Why `vllm_layout` refuses GPT-OSS (`config validate` and the vllm adapter quote it).
GPT_OSS_REFUSAL = (
    "model_type {family!r}: vLLM holds GPT-OSS's experts transposed relative to the "
    "checkpoint (its loader stores w13_weight = gate_up_proj.permute(0, 2, 1) and w2_weight "
    "= down_proj.permute(0, 2, 1)), which PeerFlow's weight sync (box copies, no "
    "transposes) cannot express, so trainer weights cannot reach it byte-exact; use "
    "rollout.backend: hf for GPT-OSS.")


def vllm_family_problem(model_type: str | None) -> str | None:
    """Why vLLM cannot take a `model_type`'s weights from a trainer, or `None` if it can.

    `None` too for an unknown `model_type` (`None`, or a model not built yet): the
    engine then checks the live parameters against `vllm_layout` when it starts.
    """
    if model_type == "gpt_oss":
        return GPT_OSS_REFUSAL.format(family=model_type)
    return None


def vocab_shard(vocab: int, tp_rank: int, tp_size: int, multiple: int) -> tuple[range, int]:
    """Returns (real vocabulary rows held, padding rows) for a padded vocab-parallel shard."""
    padded = pad_to_multiple(vocab, multiple)
    rows = split_even(padded, tp_size, tp_rank, what=f"padded vocabulary rows ({padded})")
    real = range(min(rows.start, vocab), min(rows.stop, vocab))
    return real, len(rows) - len(real)


def vocab_spec(name: str, local_name: str, shape: ModelShape, coords: RankCoords,
               multiple: int, *, dtype: str, replica: int) -> ShardSpec:
    """Returns the spec of a padded vocab-parallel embedding or LM-head shard."""
    real, pad = vocab_shard(shape.vocab_size, coords.tp_rank, coords.tp_size, multiple)
    seg = rows_of(name, (shape.vocab_size, shape.hidden_size), real)
    return stack(local_name, [seg], dtype=dtype, replica=replica, pad_rows=pad)


def dense_mlp(shape: ModelShape, layer: int, mlp: range, *, fc1: str, fc2: str, dtype: str,
              rep: int, own: int) -> list[ShardSpec]:
    """Returns a dense layer's tp-split MLP: stacked `[gate_r; up_r]` `fc1`, row-parallel `fc2`.

    Args:
        shape: Model shape.
        layer: Global layer index.
        mlp: This rank's MLP channels.
        fc1: Local name (without `.weight`/`.bias`) of the fused gate/up projection.
        fc2: Local name (without `.weight`/`.bias`) of the down projection.
        dtype: torch dtype name of the local tensors.
        rep: Replica index of replicated tensors (the down-projection bias).
        own: Replica index of this rank's own shards.
    """
    p, i, h = f"model.layers.{layer}.mlp.", shape.intermediate_size, shape.hidden_size
    kinds = ("weight", "bias") if shape.mlp_bias else ("weight",)
    specs = [stack(f"{fc1}.{kind}", [rows_of(f"{p}{proj}.{kind}", (i, h)[:dims], mlp)
                                     for proj in ("gate_proj", "up_proj")],
                   dtype=dtype, replica=own)
             for kind, dims in zip(kinds, (2, 1))]
    specs.append(col_split(f"{p}down_proj.weight", (h, i), mlp, dtype=dtype, replica=own,
                           local_name=f"{fc2}.weight"))
    if shape.mlp_bias:
        specs.append(whole(f"{p}down_proj.bias", (h,), dtype=dtype, replica=rep,
                           local_name=f"{fc2}.bias"))
    return specs


def stage_ends(shape: ModelShape, coords: RankCoords, multiple: int, *,
               names: tuple[str, str, str], dtype: str) -> tuple[list[ShardSpec], list[ShardSpec]]:
    """Returns (first-stage specs, last-stage specs): embedding; final norm and LM head.

    Args:
        shape: Model shape.
        coords: This rank's coordinates.
        multiple: Padding multiple of the whole vocabulary.
        names: Local names of (embedding, final norm, LM head).
        dtype: torch dtype name of the local tensors.
    """
    embed, norm, head = names
    own = coords.own_replica
    first: list[ShardSpec] = []
    last: list[ShardSpec] = []
    if coords.pp_rank == 0:
        first.append(vocab_spec(EMBED, embed, shape, coords, multiple, dtype=dtype, replica=own))
    if coords.pp_rank == coords.pp_size - 1:
        last.append(whole(FINAL_NORM, (shape.hidden_size,), dtype=dtype, local_name=norm,
                          replica=coords.tp_replica))
        if not shape.tie_word_embeddings:
            last.append(vocab_spec(LM_HEAD, head, shape, coords, multiple, dtype=dtype,
                                   replica=own))
        elif coords.pp_size > 1:
            last.append(vocab_spec(EMBED, head, shape, coords, multiple, dtype=dtype,
                                   replica=replica_index(1, 2, coords.dp_rank)))
    return first, last


def kv_heads_of_rank(shape: ModelShape, tp_rank: int, tp_size: int) -> range:
    """Returns the kv heads a tp rank holds (`QKVParallelLinear`, replicating when needed)."""
    if tp_size >= shape.num_kv_heads:
        if tp_size % shape.num_kv_heads:
            split_even(tp_size, shape.num_kv_heads, 0, what="tp ranks per kv head",
                       dim="num_kv_heads")
        head = tp_rank // (tp_size // shape.num_kv_heads)
        return range(head, head + 1)
    return split_even(shape.num_kv_heads, tp_size, tp_rank, what="key/value heads")


def vllm_layout(config: Any, coords: RankCoords = ONE_RANK, *,
                vocab_multiple: int = VOCAB_MULTIPLE, dtype: str = "float32",
                experts_prefix: str = VLLM_EXPERTS) -> list[ShardSpec]:
    """Returns the specs of one vLLM (or SGLang) rank's parameters, in module order.

    Args:
        config: HF config (object or dict) or `ModelShape`.
        coords: The rank's coordinates; the expert tp size defaults to `tp_size` when
            `ep_size == 1`, else 1.
        vocab_multiple: Vocabulary padding multiple (vLLM: 64).
        dtype: torch dtype name of the local tensors.
        experts_prefix: Where the fused expert tensors live under `mlp.` (`VLLM_EXPERTS`,
            `SGLANG_EXPERTS`).

    Raises:
        ConfigError: a degree does not divide heads, MLP width, experts or padded vocab;
            a family whose experts vLLM holds transposed (GPT-OSS).
    """
    shape = ModelShape.from_hf_config(config)
    if shape.packed_experts:
        raise ConfigError(GPT_OSS_REFUSAL.format(family=shape.family))
    rep, own, h = coords.tp_replica, coords.own_replica, shape.hidden_size
    tp_rank, tp_size = coords.tp_rank, coords.tp_size
    heads = split_even(shape.num_heads, tp_size, tp_rank, what="attention heads")
    kv = kv_heads_of_rank(shape, tp_rank, tp_size)
    kv_copy = 0 if tp_size <= shape.num_kv_heads else tp_rank % (tp_size // shape.num_kv_heads)
    mlp = split_even(shape.intermediate_size, tp_size, tp_rank, what="MLP channels")
    first, last = stage_ends(shape, coords, vocab_multiple, names=(EMBED, FINAL_NORM, LM_HEAD),
                             dtype=dtype)
    specs = first
    for layer in coords.stage(shape):
        p = f"model.layers.{layer}."
        specs.append(whole(f"{p}input_layernorm.weight", (h,), dtype=dtype, replica=rep))
        specs.extend(_attention(shape, layer, heads, kv, kv_copy, dtype=dtype, rep=rep, own=own))
        specs.append(whole(f"{p}post_attention_layernorm.weight", (h,), dtype=dtype,
                           replica=rep))
        if shape.is_sparse(layer):
            specs.extend(_moe(shape, layer, coords, dtype, experts_prefix))
            continue
        specs.extend(dense_mlp(shape, layer, mlp, fc1=f"{p}mlp.gate_up_proj",
                               fc2=f"{p}mlp.down_proj", dtype=dtype, rep=rep, own=own))
    specs.extend(last)
    return specs


def _attention(shape: ModelShape, layer: int, heads: range, kv: range, kv_copy: int, *,
               dtype: str, rep: int, own: int) -> list[ShardSpec]:
    """Returns one layer's attention specs: fused `qkv_proj`, `o_proj`, q/k norms."""
    a, hd, h = f"model.layers.{layer}.self_attn.", shape.head_dim, shape.hidden_size
    q_rows = range(heads.start * hd, heads.stop * hd)
    kv_rows = range(kv.start * hd, kv.stop * hd)
    specs: list[ShardSpec] = []
    for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
        segments = [
            rows_of(f"{a}{proj}.{kind}", (total, h) if kind == "weight" else (total,), rows)
            for proj, rows, total in (("q_proj", q_rows, shape.q_rows),
                                      ("k_proj", kv_rows, shape.kv_rows),
                                      ("v_proj", kv_rows, shape.kv_rows))
        ]
        # Query rows are unique per rank; a replicated kv head makes the whole fused
        # tensor a non-primary copy on all but the first rank holding that head.
        specs.append(stack(f"{a}qkv_proj.{kind}", segments, dtype=dtype,
                           replica=own if kv_copy == 0 else rep))
    specs.append(col_split(f"{a}o_proj.weight", (h, shape.q_rows), q_rows, dtype=dtype,
                           replica=own))
    if shape.o_bias:
        specs.append(whole(f"{a}o_proj.bias", (h,), dtype=dtype, replica=rep))
    if shape.qk_norm:
        for norm in ("q_norm", "k_norm"):
            specs.append(whole(f"{a}{norm}.weight", (hd,), dtype=dtype, replica=rep))
    return specs


def _moe(shape: ModelShape, layer: int, coords: RankCoords, dtype: str,
         experts: str) -> list[ShardSpec]:
    h, i = shape.hidden_size, shape.moe_intermediate_size
    held, width, expert_rep = coords.expert_split(
        shape, coords.tp_size if coords.ep_size == 1 else 1)
    p = f"model.layers.{layer}.{shape.moe_block}."  # vLLM keeps the checkpoint's module name
    w13: list[Segment] = []
    w2: list[Segment] = []
    for e in held:
        w13.append(rows_of(shape.expert_tensor(layer, e, 0), (i, h), width))
        w13.append(rows_of(shape.expert_tensor(layer, e, 1), (i, h), width))
        w2.append(rows_of(shape.expert_tensor(layer, e, 2), (h, i), range(h), cols=width))
    return [
        whole(shape.router_name(layer), (shape.num_experts, h), dtype=dtype,
              replica=coords.tp_replica),
        stack(f"{p}{experts}w13_weight", w13, dtype=dtype, replica=expert_rep),
        stack(f"{p}{experts}w2_weight", w2, dtype=dtype, replica=expert_rep),
    ]


def sglang_layout(config: Any, coords: RankCoords = ONE_RANK, **options: Any) -> list[ShardSpec]:
    """SGLang's layout: vLLM's names, stacking and padding, experts under `mlp.experts.`."""
    return vllm_layout(config, coords, **{"experts_prefix": SGLANG_EXPERTS, **options})

def tp_prefixed_layout(config: Any, tp_size: int, *,
                       builder: Callable[..., list[ShardSpec]] = vllm_layout,
                       **options: Any) -> list[ShardSpec]:
    """Returns every tp rank's specs for an engine that loads all ranks from one process.

    With `tp_size > 1` each local name gets a `tp{rank}/` prefix (`split_tp_prefix`
    reverses it); with one rank the names are the `builder`'s own (`options`: its keywords).
    """
    targets = []
    for tp_rank in range(tp_size):
        for spec in builder(config, RankCoords(tp_rank=tp_rank, tp_size=tp_size), **options):
            if tp_size > 1:
                spec = attrs.evolve(spec, local_name=f"tp{tp_rank}/{spec.local_name}")
            targets.append(spec)
    return targets


def split_tp_prefix(local_name: str) -> tuple[int, str]:
    """Returns `(tp_rank, engine_name)` of a `tp_prefixed_layout` name (`tp{r}/name` or `name`)."""
    head, sep, rest = local_name.partition("/")
    if sep and head.startswith("tp") and head[2:].isdigit():
        return int(head[2:]), rest
    return 0, local_name


_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")


def hf_to_vllm(name: str) -> tuple[str, str | int | tuple[str, int] | None]:
    """Returns `(vLLM parameter name, shard id)` receiving HF tensor `name`.

    The shard id is what vLLM's weight loaders take: `"q"`/`"k"`/`"v"` for `qkv_proj`,
    `0`/`1` for `gate_up_proj`, `("w1"|"w3"|"w2", expert)` for FusedMoE, `None` for an
    unfused parameter.
    """
    match = _EXPERT.match(name)
    if match:
        param, shard = EXPERT_PARAMS[match.group(3)]
        layer = match.group(1).removesuffix("experts")
        return f"{layer}{VLLM_EXPERTS}{param}", (shard, int(match.group(2)))
    for fused, hf, shard_id in STACKED:
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{fused}."), shard_id
    return name, None


def vllm_to_hf(name: str, config: Any) -> tuple[str, ...]:
    """Returns the HF tensors a vLLM parameter holds pieces of (in local order).

    Raises:
        KeyError: `name` is not a parameter of vLLM's module for this config.
    """
    for spec in vllm_layout(config):
        if spec.local_name == name:
            return spec.names
    family = ModelShape.from_hf_config(config).family
    raise KeyError(f"{name!r} is not a vLLM parameter of this {family} model")
