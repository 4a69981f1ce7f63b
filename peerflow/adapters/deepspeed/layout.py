"""What the DeepSpeed engine exports on each rank, as a pure function of config and layout.

Every HF parameter is one full-tensor `ShardSpec` on every dp rank; its *owner* (the rank
that sends it, `replica == 0`) is chosen by `owners_by_size`, so a sync spreads the bytes
over the dp ranks instead of funnelling them through rank 0. Other ranks carry the same
spec with `replica = (rank - owner) mod dp`.
"""

from __future__ import annotations

from typing import Any

import attrs

from peerflow.adapters.deepspeed.loading import owners_by_size
from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout
from peerflow.models import ModelShape, hf_layout, hf_parameters
from peerflow.shard import ShardSpec

#: HF families whose module tensors map onto canonical names: dense ones one to one,
#: Qwen3-MoE's and Mixtral's packed experts by their 2-D views, GPT-OSS's as the checkpoint
#: holds them (`peerflow.models.packed_experts`).
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "gpt_oss")


def check_layout(layout: ParallelLayout) -> None:
    """Raises `ConfigError` unless the layout is data parallel only."""
    if layout.tp * layout.pp * layout.ep * layout.cp != 1:
        raise ConfigError(
            f"trainer.backend=deepspeed got layout {layout.describe()}; DeepSpeed ZeRO here is "
            "data parallel only (tp=pp=ep=cp=1). Use trainer.backend=megatron for tensor or "
            "pipeline parallelism."
        )


def deepspeed_shard_layout(hf_config: Any, layout: ParallelLayout, rank: int,
                           dtype: str = "float32") -> list[ShardSpec]:
    """Returns `weight_sources()` of global rank `rank` of `layout` for `hf_config`."""
    check_layout(layout)
    family = ModelShape.from_hf_config(hf_config).family
    if family not in FAMILIES:
        raise ConfigError(
            f"trainer.backend=deepspeed: model_type {family!r} is not supported for weight "
            f"export; supported: {FAMILIES}."
        )
    dp_rank, dp = layout.dp_rank(rank), layout.dp
    if ModelShape.from_hf_config(hf_config).num_experts:
        specs = hf_layout(hf_config, dtype=dtype, packed_experts=True)
        owners = owners_by_size([(s.local_name, s.local_shape) for s in specs], dp)
        return [attrs.evolve(s, replica=(dp_rank - owners[s.local_name]) % dp) for s in specs]
    shapes = hf_parameters(hf_config)
    owners = owners_by_size(list(shapes.items()), dp)
    return [ShardSpec.of_slice(name, shape, dtype=dtype, replica=(dp_rank - owners[name]) % dp)
            for name, shape in shapes.items()]


def adapter_shard_layout(shapes: dict[str, tuple[int, ...]], layout: ParallelLayout,
                         rank: int) -> list[ShardSpec]:
    """`weight_sources()` with `trainer.lora`: every adapter tensor on every dp rank.

    Full shapes under peft's names, each sent by one owner as `deepspeed_shard_layout` does.
    """
    dp_rank, dp = layout.dp_rank(rank), layout.dp
    owners = owners_by_size(list(shapes.items()), dp)
    return [ShardSpec.of_slice(name, shape, replica=(dp_rank - owners[name]) % dp)
            for name, shape in shapes.items()]
