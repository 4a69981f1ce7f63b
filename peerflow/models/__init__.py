"""Per-family HF name/layout converters: `ShardSpec` lists for every engine layout.

Adapters describe their local tensors with these builders (all return `list[ShardSpec]`
in the engine's parameter order; a rank's place in the tp/pp/ep/dp mesh is one
`RankCoords` value, `RankCoords.of(parallel_layout, rank)`, default one rank):

* `hf_parameters(config)` — canonical HF tensors (name → shape), experts one by one.
* `hf_layout(config, coords, shard_rank=, shard_size=, packed_experts=)` —
  HF module names, whole or FSDP2 dim-0 shards; whole tensors are replica
  `coords.dp_rank`, as every builder takes replica indices from `coords`.
* `tp_layout(config, coords)` — HF names under DTensor tensor parallelism.
* `vllm_layout(config, coords)` / `sglang_layout` — stacked `qkv_proj` and
  `gate_up_proj`, padded vocab-parallel embedding and LM head, FusedMoE `w13`/`w2`.
* `megatron_layout(config, coords, …)` — interleaved `linear_qkv`, fused
  `linear_fc1`, padded vocab, SequentialMLP or TEGroupedMLP experts.

Name converters: `hf_to_vllm` / `vllm_to_hf`, `hf_to_megatron` / `megatron_to_hf`.
`config` is a `transformers` config, its dict, or a `ModelShape`. Supported families:
Llama (and Mistral-style), Qwen2, Qwen3, Qwen3-MoE, Mixtral, GPT-OSS
(`peerflow.models.<family>` modules; GPT-OSS has no vLLM/SGLang or Megatron layout).
"""

from __future__ import annotations

from peerflow.models import (  # noqa: F401  (register families)
    gpt_oss,
    llama,
    mixtral,
    qwen2,
    qwen3,
    qwen3_moe,
)
from peerflow.models.common import (
    RankCoords,
    restrict_rows,
    split_chunk,
    split_even,
    stage_layers,
)
from peerflow.models.config import ModelShape
from peerflow.models.hf import hf_layout, hf_parameters, tp_layout
from peerflow.models.megatron import hf_to_megatron, megatron_layout, megatron_to_hf, padded_vocab
from peerflow.models.vllm import hf_to_vllm, sglang_layout, vllm_layout, vllm_to_hf
from peerflow.rounding import pad_to_multiple

__all__ = [
    "ModelShape",
    "RankCoords",
    "hf_layout",
    "hf_parameters",
    "hf_to_megatron",
    "hf_to_vllm",
    "megatron_layout",
    "megatron_to_hf",
    "pad_to_multiple",
    "padded_vocab",
    "restrict_rows",
    "sglang_layout",
    "split_chunk",
    "split_even",
    "stage_layers",
    "tp_layout",
    "vllm_layout",
    "vllm_to_hf",
]
