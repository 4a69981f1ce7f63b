"""The tiny-model builder makes Qwen3-MoE, Mixtral and GPT-OSS models transformers loads."""

from __future__ import annotations

import pytest

from peerflow.contrib.tasks.tiny_model import TinyModelOptions, build_tiny_model, cache_key


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_builder_makes_a_moe_model_with_the_asked_experts(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    from peerflow.models.moe_routers import find_routers

    options = TinyModelOptions(model_type=model_type, hidden_size=64, intermediate_size=128,
                               num_heads=2, num_kv_heads=2, num_experts=4,
                               num_experts_per_tok=2)
    path = build_tiny_model("digits", ["0123456789"], options, cache_dir=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path)
    routers = list(find_routers(model))
    assert [layer for layer, _, _ in routers] == [0, 1]  # every layer sparse
    assert all(r.top_k == 2 and r.weight.shape == (4, 64) for _, _, r in routers)
    assert model.config.head_dim == 32  # vLLM-CPU's attention needs head_dim >= 32
    experts = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp.experts"))
    assert experts.down_proj.shape[0] == 4 and 32 in experts.down_proj.shape  # 128 / 4 wide


def test_dense_cache_keys_are_unchanged_by_the_moe_options():
    dense = TinyModelOptions()
    assert cache_key("digits", ["01"], dense) == cache_key(
        "digits", ["01"], TinyModelOptions(num_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        TinyModelOptions(model_type="mixtral", num_experts=4, num_experts_per_tok=5)
