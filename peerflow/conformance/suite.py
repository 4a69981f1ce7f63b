"""The base test classes adapter authors subclass (test names are public API).

    from peerflow.conformance import RolloutAdapterSuite

    class TestMyEngine(RolloutAdapterSuite):
        adapter_class = MyRolloutEngine

Layers, selectable with `-m "peerflow_layer(…)"`-free `-k l0_`, `-k l2_`, …:

0. surface — contract implemented, registered, capabilities and options declared;
1. layout invariants of the declared shards (`shard_layout`) for several models/layouts;
2. CPU round trip against the oracle with `torch.arange` weights for every layout pair
   (rollout adapters also from every registered trainer layout);
3. the real engine: declared layout equals the engine's, bit-exact load/export read back
   around the adapter, corrupt-then-restore, log-probs against a plain HF model;
   generate contract (`layer_generate`, `-k generate`): result order, finish reasons,
   EOS, stop tokens and strings, greedy, seeds, top-k/top-p, torch's global RNG;
   LoRA (`layer_lora`, `-k lora`): with `Capabilities.lora`, adapter-only syncs and
   training against transformers + peft;
   train (`layer_train`, `-k l3_train`): one `train_step` at dp = 1 and dp = 2 against
   a plain autograd + AdamW reference, shared prompts, checkpoint round trip;
4. GPU-only checks (marked `gpu`).
"""

from __future__ import annotations

from peerflow.conformance.layer3_rollout import Layer3RolloutEngine
from peerflow.conformance.layer_generate import LayerGenerate
from peerflow.conformance.layer_lora import LayerLora
from peerflow.conformance.layer_train import LayerTrain
from peerflow.conformance.layers import (
    Layer0Surface,
    Layer1Layouts,
    Layer2FromTrainers,
    Layer2RoundTrip,
)
from peerflow.conformance.layers_engine import Layer3TrainEngine, Layer4Gpu


class RolloutAdapterSuite(Layer0Surface, Layer1Layouts, Layer2RoundTrip, Layer2FromTrainers,
                          Layer3RolloutEngine, LayerGenerate, LayerLora, Layer4Gpu):
    """Every layer for a `peerflow.RolloutEngine` adapter (its shards are destinations)."""

    suite_kind = "rollout"


class TrainAdapterSuite(Layer0Surface, Layer1Layouts, Layer2RoundTrip, Layer3TrainEngine,
                        LayerTrain, LayerLora, Layer4Gpu):
    """Every layer for a `peerflow.TrainEngine` adapter (its shards are sources)."""

    suite_kind = "train"
