"""The built-in `hf` rollout engine with conformance hooks, and a broken variant.

`HFWithHooks` adds the hooks the suite reads (`shard_layout`, `conformance_read_weights`)
to the real engine; `HFSwapsKV` loads `k_proj` data into `v_proj` and vice versa — the
kind of bug layer 3 exists to catch.
"""

from __future__ import annotations

from peerflow.adapters.hf.engine import HFRolloutEngine
from peerflow.models import hf_layout


class HFWithHooks(HFRolloutEngine):
    @classmethod
    def shard_layout(cls, hf_config, layout, rank):
        return hf_layout(hf_config)

    @classmethod
    def conformance_read_weights(cls, engine):
        return dict(engine.model.named_parameters())


class HFSwapsKV(HFWithHooks):
    def weight_buffers(self, specs):
        return None  # stage copies, so every tensor reaches the buggy load_weights

    def load_weights(self, items):
        by_name = {spec.local_name: (spec, tensor) for spec, tensor in items}
        swapped = []
        for spec, tensor in items:
            other = spec.local_name.replace("k_proj", "@").replace("v_proj", "k_proj") \
                .replace("@", "v_proj")
            if other != spec.local_name and other in by_name:
                tensor = by_name[other][1]
            swapped.append((spec, tensor))
        super().load_weights(swapped)
