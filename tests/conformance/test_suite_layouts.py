"""Layers 1–2 of the suite against vLLM-, Megatron- and FSDP-style layouts (the matrix)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from layout_adapters import (  # noqa: E402
    FsdpStyleLayouts,
    MegatronStyleLayouts,
    VllmStyleLayouts,
)

from peerflow.conformance.layers import Layer1Layouts, Layer2RoundTrip  # noqa: E402


class TestVllmStyleRollout(Layer1Layouts, Layer2RoundTrip):
    suite_kind = "rollout"
    adapter_class = VllmStyleLayouts


class TestMegatronStyleTrain(Layer1Layouts, Layer2RoundTrip):
    suite_kind = "train"
    adapter_class = MegatronStyleLayouts


class TestFsdpStyleTrain(Layer1Layouts, Layer2RoundTrip):
    suite_kind = "train"
    adapter_class = FsdpStyleLayouts
