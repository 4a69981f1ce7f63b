"""The built-in trainer layouts a rollout adapter must accept weights from.

Every registered train engine with a `shard_layout` hook contributes each of its
conformance layouts (FSDP dp shards, DTensor tp, Megatron tp/pp, DeepSpeed ZeRO-3
owners, and whatever a third-party trainer declares), so layers 2 and 3 of a rollout
adapter sync from exactly the layouts real runs sync from.
"""

from __future__ import annotations

from typing import Any

import attrs

from peerflow.conformance.profile import AdapterProfile, layout_id
from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout
from peerflow.shard import ShardSpec


@attrs.frozen(kw_only=True)
class TrainerLayout:
    """One layout of one registered train engine."""

    name: str
    """The train engine's registry name."""
    cls: type
    """The train engine class."""
    layout: ParallelLayout
    """Its layout."""

    @property
    def id(self) -> str:
        """Test id, e.g. `megatron-tp2pp2`."""
        return f"{self.name}-{layout_id(self.layout)}"

    def specs(self, hf_config: Any, dtype: str = "float32") -> dict[int, list[ShardSpec]] | None:
        """`weight_sources()` of every rank, or `None` when the trainer refuses the model."""
        profile = AdapterProfile.of(self.cls)
        try:
            return {rank: list(profile.shard_layout(hf_config, self.layout, rank, dtype=dtype))
                    for rank in self.layout.global_ranks}
        except ConfigError:
            return None


def trainer_layouts() -> list[TrainerLayout]:
    """Every registered train engine's conformance layouts it has the capabilities for."""
    from peerflow.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("train_engine")
    out = []
    for name in sorted(registry.names()):
        profile = AdapterProfile.of(registry.get(name))
        if profile.hook("shard_layout") is None:
            continue
        out += [TrainerLayout(name=name, cls=profile.cls, layout=layout)
                for layout in profile.layouts() if profile.missing_capability(layout) is None]
    return out
