"""Which Megatron shards each rank holds, as a pure function of config and layout."""

from __future__ import annotations

from typing import Any

from peerflow.adapters.megatron.model import check_supported
from peerflow.errors import ConfigError
from peerflow.shard import ShardSpec


def megatron_shard_layout(hf_config: Any, layout: Any, rank: int, *,
                          vocab_multiple: int = 128, dtype: str = "float32") -> list[ShardSpec]:
    """Returns the Megatron shards of global rank `rank` of `layout`.

    Megatron's default rank order (tp fastest, then dp, then pp) is `ParallelLayout`'s.
    """
    from peerflow.models import RankCoords, megatron_layout

    if layout.ep * layout.cp != 1:
        raise ConfigError(f"trainer.backend=megatron: layout {layout.describe()} uses ep/cp, "
                          "which the adapter does not wire up.")
    shape = check_supported(hf_config)
    layout.check_divides("layers", shape.num_layers, dim="pp")
    return megatron_layout(hf_config, RankCoords.of(layout, rank),
                           vocab_multiple=vocab_multiple, dtype=dtype)
