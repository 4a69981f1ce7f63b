"""Canonical HF tensors and the layouts of engines that keep HF names.

* `hf_parameters(config)`: every canonical tensor (name → shape), experts one by one.
* `hf_layout(config, …)`: HF module parameters held whole or as dim-0 shards
  (`torch.distributed.fsdp.fully_shard` / DTensor `Shard(0)`, `torch.chunk` semantics),
  optionally a pipeline stage, optionally with `transformers` ≥ 5's packed experts.
* `tp_layout(config, tp_rank, tp_size, …)`: HF names split Megatron-style by DTensor
  tensor parallelism (`ColwiseParallel` q/k/v/gate/up and LM head, `RowwiseParallel`
  o/down and embedding), norms and row-parallel biases replicated.
"""

from __future__ import annotations

from typing import Any

from peerflow.models.common import (
    ONE_RANK,
    RankCoords,
    Segment,
    replica_index,
    restrict_rows,
    rows_of,
    split_chunk,
    split_even,
    stack,
    whole,
)
from peerflow.models.config import ModelShape
from peerflow.shard import Box, ShardSpec

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def layer_prefix(layer: int) -> str:
    """Returns the HF name prefix of decoder layer `layer`."""
    return f"model.layers.{layer}."


def expert_prefix(layer: int, expert: int) -> str:
    """Returns the canonical HF name prefix of one expert."""
    return f"model.layers.{layer}.mlp.experts.{expert}."


def layer_parameters(shape: ModelShape, layer: int) -> dict[str, tuple[int, ...]]:
    """Returns the canonical tensors of decoder layer `layer` (name → shape), in HF order."""
    p, h = layer_prefix(layer), shape.hidden_size
    out: dict[str, tuple[int, ...]] = {f"{p}input_layernorm.weight": (h,)}
    a = f"{p}self_attn."
    out[f"{a}q_proj.weight"] = (shape.q_rows, h)
    out[f"{a}k_proj.weight"] = (shape.kv_rows, h)
    out[f"{a}v_proj.weight"] = (shape.kv_rows, h)
    if shape.qkv_bias:
        out[f"{a}q_proj.bias"] = (shape.q_rows,)
        out[f"{a}k_proj.bias"] = (shape.kv_rows,)
        out[f"{a}v_proj.bias"] = (shape.kv_rows,)
    out[f"{a}o_proj.weight"] = (h, shape.q_rows)
    if shape.o_bias:
        out[f"{a}o_proj.bias"] = (h,)
    if shape.qk_norm:
        out[f"{a}q_norm.weight"] = (shape.head_dim,)
        out[f"{a}k_norm.weight"] = (shape.head_dim,)
    if shape.attn_sinks:
        out[f"{a}sinks"] = (shape.num_heads,)
    out[f"{p}post_attention_layernorm.weight"] = (h,)
    if shape.is_sparse(layer):
        out.update(_moe_parameters(shape, layer))
    else:
        i = shape.intermediate_size
        for proj, dims in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            out[f"{p}mlp.{proj}.weight"] = dims
        if shape.mlp_bias:
            out[f"{p}mlp.gate_proj.bias"] = (i,)
            out[f"{p}mlp.up_proj.bias"] = (i,)
            out[f"{p}mlp.down_proj.bias"] = (h,)
    return out


def _moe_parameters(shape: ModelShape, layer: int) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and experts, as its checkpoints name them."""
    e, i, h = shape.num_experts, shape.moe_intermediate_size, shape.hidden_size
    out = {shape.router_name(layer): (e, h)}
    if shape.packed_experts:  # GPT-OSS: biased router, packed biased experts
        x = f"model.layers.{layer}.{shape.moe_block}."
        out[f"{x}router.bias"] = (e,)
        out.update({f"{x}experts.gate_up_proj": (e, h, 2 * i),
                    f"{x}experts.gate_up_proj_bias": (e, 2 * i),
                    f"{x}experts.down_proj": (e, i, h), f"{x}experts.down_proj_bias": (e, h)})
        return out
    for expert in range(e):
        for which, dims in enumerate(((i, h), (i, h), (h, i))):
            out[shape.expert_tensor(layer, expert, which)] = dims
    return out


def module_name(shape: ModelShape, name: str) -> str:
    """The `transformers` ≥ 5 module parameter holding checkpoint tensor `name` (non-expert).

    Mixtral's checkpoints call the MoE module `block_sparse_moe`; `transformers` calls it
    `mlp`. Every other name is the same.
    """
    if shape.moe_block != "mlp":
        return name.replace(f".{shape.moe_block}.", ".mlp.", 1)
    return name


def hf_parameters(config: Any) -> dict[str, tuple[int, ...]]:
    """Returns every canonical HF tensor of the model (name → shape), in HF order.

    Tied models have no `lm_head.weight`. MoE experts appear one by one, as in HF
    checkpoints.
    """
    shape = ModelShape.from_hf_config(config)
    out = {EMBED: (shape.vocab_size, shape.hidden_size)}
    for layer in range(shape.num_layers):
        out.update(layer_parameters(shape, layer))
    out[FINAL_NORM] = (shape.hidden_size,)
    if not shape.tie_word_embeddings:
        out[LM_HEAD] = (shape.vocab_size, shape.hidden_size)
    return out


def packed_expert_specs(shape: ModelShape, layer: int,
                        dtype: str) -> list[tuple[ShardSpec, int]]:
    """Specs (2-D views) of `transformers` ≥ 5 packed experts, with rows per expert.

    Returns:
        `[(gate_up_proj spec, 2 * I), (down_proj spec, H)]` of layer `layer`.
    """
    p, i = f"model.layers.{layer}.mlp.experts.", shape.moe_intermediate_size
    params = layer_parameters(shape, layer)
    gate_up: list[Segment] = []
    down: list[Segment] = []
    for e in range(shape.num_experts):
        for which in (0, 1):
            name = shape.expert_tensor(layer, e, which)
            gate_up.append(rows_of(name, params[name], range(i)))
        name = shape.expert_tensor(layer, e, 2)
        down.append(rows_of(name, params[name], range(shape.hidden_size)))
    return [
        (stack(f"{p}gate_up_proj", gate_up, dtype=dtype), 2 * i),
        (stack(f"{p}down_proj", down, dtype=dtype), shape.hidden_size),
    ]


def hf_layout(config: Any, coords: RankCoords = ONE_RANK, *, shard_rank: int = 0,
              shard_size: int = 1, packed_experts: bool = False, replica: int | None = None,
              dtype: str = "float32") -> list[ShardSpec]:
    """Returns the specs of an HF-named model held whole or as FSDP dim-0 shards.

    Args:
        config: HF config (object or dict) or `ModelShape`.
        coords: This rank's place, as `vllm_layout` takes it (`RankCoords.of(layout,
            rank)`): its pipeline stage (the first holds the embedding, the last the
            final norm and LM head; with tied embeddings and `pp_size > 1` the last
            stage's `lm_head.weight` is a replica of the embedding) and its dp rank (the
            replica index of whole tensors); tp/ep are not used.
        shard_rank: This rank's index in the FSDP shard group.
        shard_size: FSDP shard group size (1: every tensor whole). Shards follow
            `torch.chunk` along dim 0 (packed experts: along the expert dimension), so
            trailing ranks may hold empty shards; those specs have no pieces.
        packed_experts: Name the tensors as `transformers` ≥ 5's modules do: experts
            packed (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj`
            `[E, H, I]`, as 2-D views `[E*2I, H]` and `[E*H, I]`) instead of one module
            per expert, Mixtral's `block_sparse_moe` as `mlp`. GPT-OSS checkpoints already
            hold the modules' tensors.
        replica: Replica index of this rank's tensors (0 sends). Default: with whole
            tensors (`shard_size == 1`) `coords.dp_rank`, since every dp replica holds
            the same tensors; with FSDP shards 0 (pass the HSDP replicate index).
        dtype: torch dtype name of the local tensors.

    Returns:
        One spec per local tensor, named as the module's `named_parameters()` names.
    """
    shape = ModelShape.from_hf_config(config)
    if replica is None:
        replica = coords.own_replica if shard_size == 1 else 0
    full: list[tuple[ShardSpec, int]] = []
    v_h = (shape.vocab_size, shape.hidden_size)
    if coords.pp_rank == 0:
        full.append((whole(EMBED, v_h, dtype=dtype), 1))
    for layer in coords.stage(shape):
        params = layer_parameters(shape, layer)
        pack = packed_experts and shape.is_sparse(layer) and not shape.packed_experts
        if pack:
            experts = f"model.layers.{layer}.{shape.moe_block}.experts."
            params = {n: s for n, s in params.items() if not n.startswith(experts)}
        full.extend((whole(n, s, dtype=dtype, local_name=module_name(shape, n)
                           if packed_experts else None), 1) for n, s in params.items())
        if pack:
            full.extend(packed_expert_specs(shape, layer, dtype))
    if coords.pp_rank == coords.pp_size - 1:
        full.append((whole(FINAL_NORM, (shape.hidden_size,), dtype=dtype), 1))
        if not shape.tie_word_embeddings:
            full.append((whole(LM_HEAD, v_h, dtype=dtype), 1))
        elif coords.pp_size > 1:
            full.append((whole(EMBED, v_h, dtype=dtype, local_name=LM_HEAD, replica=1), 1))
    specs = []
    for spec, unit in full:
        spec = spec if spec.replica else _with_replica(spec, replica)
        if shard_size > 1:
            items = split_chunk(spec.local_shape[0] // unit, shard_size, shard_rank)
            spec = restrict_rows(spec, range(items.start * unit, items.stop * unit))
        specs.append(spec)
    return specs


def _with_replica(spec: ShardSpec, replica: int) -> ShardSpec:
    if replica == spec.replica:
        return spec
    return ShardSpec(local_name=spec.local_name, local_shape=spec.local_shape,
                     pieces=spec.pieces, dtype=spec.dtype, padding=spec.padding,
                     replica=replica)


def col_split(name: str, shape: tuple[int, ...], cols: range, *, dtype: str,
              replica: int = 0, local_name: str | None = None) -> ShardSpec:
    """Returns the spec of columns `cols` of a 2-D HF tensor (a row-parallel shard)."""
    box = Box(offsets=(0, cols.start), sizes=(shape[0], len(cols)))
    return ShardSpec.of_slice(name, shape, box, local_name=local_name, dtype=dtype,
                              replica=replica)


def row_split(name: str, shape: tuple[int, ...], rows: range, *, dtype: str,
              local_name: str | None = None) -> ShardSpec:
    """Returns the spec of rows `rows` of an HF tensor (a column-parallel shard)."""
    seg = rows_of(name, shape, rows)
    return stack(local_name or name, [seg], dtype=dtype)


#: Mixtral's expert projections, by what they are.
_MIXTRAL_LEAVES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def tp_layout(config: Any, coords: RankCoords, *, dtype: str = "float32") -> list[ShardSpec]:
    """Returns the specs of an HF-named model under DTensor tensor parallelism.

    Column-parallel (rows split, heads kept whole): q/k/v, gate/up (and their biases),
    each expert's gate/up, and `lm_head` (`torch.chunk` of the vocabulary). Row-parallel
    (columns split): o_proj, down_proj, each expert's down_proj; the embedding is split
    by vocabulary rows (`torch.chunk`). Norms, routers and row-parallel biases are
    replicated over tp (replica = `dp_rank * tp_size + tp_rank`). `coords`' ep is not used.

    Raises:
        ConfigError: `tp_size` does not divide the heads, kv heads or MLP width.
    """
    shape = ModelShape.from_hf_config(config)
    rep, own, hd = coords.tp_replica, coords.own_replica, shape.head_dim
    tp_rank, tp_size = coords.tp_rank, coords.tp_size
    heads = split_even(shape.num_heads, tp_size, tp_rank, what="attention heads")
    kv = split_even(shape.num_kv_heads, tp_size, tp_rank, what="key/value heads")
    q_rows = range(heads.start * hd, heads.stop * hd)
    kv_rows = range(kv.start * hd, kv.stop * hd)
    specs: list[ShardSpec] = []

    def add(spec: ShardSpec, replica: int) -> None:
        specs.append(_with_replica(spec, replica))

    v_h = (shape.vocab_size, shape.hidden_size)
    vocab = split_chunk(shape.vocab_size, tp_size, tp_rank)
    if coords.pp_rank == 0:
        add(row_split(EMBED, v_h, vocab, dtype=dtype), own)
    for layer in coords.stage(shape):
        for name, dims in layer_parameters(shape, layer).items():
            leaf = name.rsplit(".", 2)[-2]
            leaf = _MIXTRAL_LEAVES.get(leaf, leaf) if ".experts." in name else leaf
            kind = name.rsplit(".", 1)[-1]
            expert = ".mlp.experts." in name
            if leaf in ("q_proj", "k_proj", "v_proj"):
                rows = q_rows if leaf == "q_proj" else kv_rows
                add(row_split(name, dims, rows, dtype=dtype), own)
            elif leaf in ("gate_proj", "up_proj"):
                width = shape.moe_intermediate_size if expert else shape.intermediate_size
                rows = split_even(width, tp_size, tp_rank, what="MLP channels")
                add(row_split(name, dims, rows, dtype=dtype), own)
            elif leaf in ("o_proj", "down_proj") and kind == "weight":
                if leaf == "o_proj":
                    cols = q_rows
                else:
                    width = shape.moe_intermediate_size if expert else shape.intermediate_size
                    cols = split_even(width, tp_size, tp_rank, what="MLP channels")
                add(col_split(name, dims, cols, dtype=dtype), own)
            else:
                add(whole(name, dims, dtype=dtype), rep)
    if coords.pp_rank == coords.pp_size - 1:
        add(whole(FINAL_NORM, (shape.hidden_size,), dtype=dtype), rep)
        if not shape.tie_word_embeddings:
            add(row_split(LM_HEAD, v_h, vocab, dtype=dtype), own)
        elif coords.pp_size > 1:
            add(row_split(EMBED, v_h, vocab, dtype=dtype, local_name=LM_HEAD),
                replica_index(1, 2, coords.dp_rank))
    return specs
