"""The conformance suite against the built-in `hf` and `fsdp` adapters (every layer).

vLLM, DeepSpeed, Megatron and SGLang run the same suite from `tests/engines/<name>/`.
"""

from __future__ import annotations

import pytest

from peerflow.adapters.fsdp.engine import FSDPTrainEngine
from peerflow.adapters.hf.engine import HFRolloutEngine
from peerflow.conformance import RolloutAdapterSuite, TrainAdapterSuite
from peerflow.conformance.layer_train import LayerTrain


class TestHFConformance(RolloutAdapterSuite):
    adapter_class = HFRolloutEngine


class TestFSDPConformance(TrainAdapterSuite):
    adapter_class = FSDPTrainEngine


# Slow tier: DeepSpeed's and Megatron's train layer (~36 s together, two processes each at
# dp = 2). The layer's contract stays proven in every default run by TestFSDPConformance
# and by the example trainer in test_train_mutants.py.
@pytest.mark.slow
class TestDeepSpeedTrainLayer(LayerTrain):
    suite_kind = "train"

    @pytest.fixture
    def adapter(self):
        return pytest.importorskip("peerflow.adapters.deepspeed.engine").DeepSpeedTrainEngine


@pytest.mark.slow
class TestMegatronTrainLayer(LayerTrain):
    suite_kind = "train"

    @pytest.fixture
    def adapter(self):
        return pytest.importorskip("peerflow.adapters.megatron.engine").MegatronTrainEngine
