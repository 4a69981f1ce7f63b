"""The `sglang` adapter on CPU: registration, install hint, declared layout (layers 0–2).

SGLang cannot be installed on CPU machines; its real-engine layer (3) runs only where
SGLang and a CUDA device are present and is skipped here with that reason.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from peerflow.adapters.sglang.engine import SGLangRolloutEngine
from peerflow.conformance.suite import RolloutAdapterSuite
from peerflow.engines import EngineContext
from peerflow.errors import EngineNotInstalledError
from peerflow.layout import ParallelLayout

pytestmark = pytest.mark.engine("sglang")

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


class TestSGLangConformance(RolloutAdapterSuite):
    """Layers 0–2 run on CPU; layer 3 skips (gpu_only) unless SGLang and CUDA are here."""

    adapter_class = SGLangRolloutEngine


def test_registered_through_entry_point(plugin_manager):
    assert plugin_manager.registry("rollout_engine").get("sglang") is SGLangRolloutEngine


def test_declares_gpu_only_and_its_abilities():
    caps = SGLangRolloutEngine.capabilities
    assert caps.gpu_only and caps.sleep and caps.in_place_weight_update
    assert caps.logprobs and caps.stop_strings and caps.multiprocess
    assert not caps.lora and "LoRA API is not wired" in caps.reasons["lora"]
    assert SGLangRolloutEngine.requires == ("sglang",)


@pytest.mark.skipif(SGLANG_INSTALLED, reason="sglang is installed here")
def test_missing_sglang_raises_install_hint(tmp_path):
    context = EngineContext(model_path=str(tmp_path), layout=ParallelLayout())
    with pytest.raises(EngineNotInstalledError, match=r"peerflow\[sglang\].*CUDA"):
        SGLangRolloutEngine(context)


def test_declared_layout_is_vllm_style_fused_and_padded():
    config = {"model_type": "qwen2", "vocab_size": 70, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "tie_word_embeddings": False}
    layout = ParallelLayout(tp=2)
    rank1 = {s.local_name: s for s in SGLangRolloutEngine.shard_layout(config, layout, 1)}
    qkv = rank1["model.layers.0.self_attn.qkv_proj.weight"]
    assert [p.name.rsplit(".", 2)[-2] for p in qkv.pieces] == ["q_proj", "k_proj", "v_proj"]
    assert qkv.local_shape == (32 + 16 + 16, 64)  # 2 of 4 q heads, 1 of 2 kv heads
    assert qkv.pieces[0].global_box.offsets == (32, 0)
    gate_up = rank1["model.layers.0.mlp.gate_up_proj.weight"]
    assert gate_up.local_shape == (128, 64)
    head = rank1["lm_head.weight"]  # 70 rows padded to 128, split in two
    assert head.local_shape == (64, 64) and head.padding
    assert rank1["model.norm.weight"].replica > 0


@pytest.mark.gpu
@pytest.mark.skipif(not (SGLANG_INSTALLED and torch.cuda.is_available()),
                    reason="needs SGLang and a CUDA GPU (SGLang has no CPU build)")
def test_generate_and_sync_on_gpu(tmp_path):
    from peerflow.bench.shapes import build_model
    from peerflow.engines import GenerationRequest, SamplingParams

    model = build_model(tmp_path / "m", {"hidden_size": 128, "intermediate_size": 256,
                                         "num_layers": 2, "num_heads": 4, "num_kv_heads": 2})
    engine = SGLangRolloutEngine(EngineContext(model_path=model, layout=ParallelLayout()))
    try:
        requests = [GenerationRequest(request_id=7, prompt_ids=(2, 3, 4))]
        results = engine.generate(requests, SamplingParams(n=2, max_tokens=6, seed=0))
        assert [(r.request_id, r.index) for r in results] == [(7, 0), (7, 1)]
        assert all(len(r.logprobs) == len(r.token_ids) for r in results)
        engine.sleep()
        engine.wake()
    finally:
        engine.shutdown()
