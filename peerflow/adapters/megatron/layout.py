"""Which Megatron shards each rank holds, as a pure function of config and layout."""

from __future__ import annotations

from typing import Any

from peerflow.adapters.megatron.model import check_supported
from peerflow.errors import ConfigError
from peerflow.shard import ShardSpec


def megatron_coords(layout: Any, rank: int) -> Any:
    """The `RankCoords` of global rank `rank`: tp, pp, and the expert block of its ep rank.

    Megatron's default rank order (tp fastest, then ep, then dp, then pp) is
    `ParallelLayout`'s. The ep peers of one dp replica see the same samples (PeerFlow's
    layout) and hold the same dense tensors, so for replica indices they count as extra
    replicas of those (`dp * ep + ep_rank`: only ep rank 0 of dp replica 0 sends them);
    their experts are distinct, replicated over dp only.
    """
    from peerflow.models import RankCoords

    coord = layout.coord(rank)
    return RankCoords(tp_rank=coord.tp, tp_size=layout.tp, pp_rank=coord.pp, pp_size=layout.pp,
                      ep_rank=coord.ep, ep_size=layout.ep, dp_rank=coord.dp * layout.ep + coord.ep,
                      expert_replica=coord.dp if layout.ep > 1 else None)


def check_moe_layout(shape: Any, layout: Any) -> None:
    """An MoE model trains with tp = pp = 1 (ep splits its experts); `ep > 1` needs experts.

    Raises:
        ConfigError: naming the layout setting to change.
    """
    if not shape.num_experts:
        if layout.ep > 1:
            raise ConfigError(f"trainer.layout.ep={layout.ep}: the {shape.family} model has no "
                              "experts to split; set trainer.layout.ep: 1.")
        return
    if layout.tp * layout.pp > 1:
        raise ConfigError(
            f"trainer.backend=megatron: the {shape.family} MoE model trains with tp=1 and pp=1 "
            f"here (got {layout.describe()}); Megatron's MoE with tp > 1 needs sequence "
            "parallelism and pp > 1 splits the routing-replay scope across stages, neither "
            "wired. Set trainer.layout.tp: 1 and pp: 1 (trainer.layout.ep splits the experts)."
        )
    layout.check_divides("experts", shape.num_experts, dim="ep")


def family_problems(family: str | None, layout: Any) -> list[str]:
    """What `config validate` refuses for a `model_type` and `trainer.layout` on megatron.

    The same rules as `check_supported` and `check_moe_layout`, from the model type alone
    (the engine re-checks the full config when it builds the model). `None` (a builder
    without a `model_type` option) is left to the engine.
    """
    from peerflow.adapters.megatron.model import MOE_FAMILIES, SUPPORTED_FAMILIES

    if family is None:
        return []
    if family not in SUPPORTED_FAMILIES + MOE_FAMILIES:
        return [f"trainer.backend=megatron: model_type {family!r} is not mapped onto "
                f"Megatron's GPTModel (dense: {list(SUPPORTED_FAMILIES)}; MoE: "
                f"{list(MOE_FAMILIES)}). Fix: use trainer.backend fsdp or deepspeed."]
    if family not in MOE_FAMILIES:
        if layout.ep > 1:
            return [f"trainer.layout.ep={layout.ep}: the {family} model has no experts to "
                    "split. Fix: set trainer.layout.ep: 1."]
        return []
    if layout.tp * layout.pp > 1:
        return [f"trainer.layout tp={layout.tp} pp={layout.pp}: the megatron trainer runs "
                f"{family} MoE models with tp=1 and pp=1 (Megatron's MoE with tp > 1 needs "
                "sequence parallelism; pp > 1 would split the routing-replay scope across "
                "stages). Fix: set trainer.layout.tp: 1 and pp: 1; trainer.layout.ep splits "
                "the experts."]
    return []


def megatron_shard_layout(hf_config: Any, layout: Any, rank: int, *,
                          vocab_multiple: int = 128, dtype: str = "float32") -> list[ShardSpec]:
    """Returns the Megatron shards of global rank `rank` of `layout`.

    Raises:
        ConfigError: `cp > 1`, a layout `check_moe_layout` refuses, or a split that does
            not divide.
    """
    from peerflow.models import megatron_layout

    if layout.cp != 1:
        raise ConfigError(f"trainer.backend=megatron: layout {layout.describe()} uses cp, "
                          "which the adapter does not wire up; set trainer.layout.cp: 1.")
    shape = check_supported(hf_config)
    check_moe_layout(shape, layout)
    layout.check_divides("layers", shape.num_layers, dim="pp")
    return megatron_layout(hf_config, megatron_coords(layout, rank),
                           vocab_multiple=vocab_multiple, dtype=dtype)
