"""Layers 1–2 of the suite against vLLM-, Megatron- and FSDP-style layouts (the matrix),
expert-parallel vLLM MoE layouts included."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from layout_adapters import (  # noqa: E402
    FsdpStyleLayouts,
    MegatronStyleLayouts,
    VllmStyleExpertLayouts,
    VllmStyleLayouts,
)

from peerflow.conformance.layers import (  # noqa: E402
    Layer1Layouts,
    Layer2FromTrainers,
    Layer2RoundTrip,
)


class TestVllmStyleRollout(Layer1Layouts, Layer2RoundTrip):
    suite_kind = "rollout"
    adapter_class = VllmStyleLayouts


class TestVllmStyleExperts(Layer1Layouts, Layer2RoundTrip, Layer2FromTrainers):
    """Expert-parallel FusedMoE shards: `ep = 2` (and 4, and dp 2 x ep 2) to `ep = 1` and
    back byte-exact, and from every built-in trainer layout that takes MoE models."""

    suite_kind = "rollout"
    adapter_class = VllmStyleExpertLayouts


class TestMegatronStyleTrain(Layer1Layouts, Layer2RoundTrip):
    suite_kind = "train"
    adapter_class = MegatronStyleLayouts


class TestFsdpStyleTrain(Layer1Layouts, Layer2RoundTrip):
    suite_kind = "train"
    adapter_class = FsdpStyleLayouts
