"""The conformance suite against the built-in `hf` and `fsdp` adapters (every layer).

vLLM, DeepSpeed, Megatron and SGLang run the same suite from `tests/engines/<name>/`.
"""

from __future__ import annotations

from peerflow.adapters.fsdp.engine import FSDPTrainEngine
from peerflow.adapters.hf.engine import HFRolloutEngine
from peerflow.conformance import RolloutAdapterSuite, TrainAdapterSuite


class TestHFConformance(RolloutAdapterSuite):
    adapter_class = HFRolloutEngine


class TestFSDPConformance(TrainAdapterSuite):
    adapter_class = FSDPTrainEngine
