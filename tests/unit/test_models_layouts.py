"""Layout builders in `peerflow.models`: coverage, fused layouts, real HF module names."""

from __future__ import annotations

import math

import pytest
import torch

from peerflow.errors import ConfigError
from peerflow.models import (
    ModelShape,
    RankCoords,
    hf_layout,
    hf_parameters,
    hf_to_megatron,
    hf_to_vllm,
    megatron_layout,
    megatron_to_hf,
    padded_vocab,
    tp_layout,
    vllm_layout,
    vllm_to_hf,
)


def at(tp_rank=0, tp_size=1, **coords):
    return RankCoords(tp_rank=tp_rank, tp_size=tp_size, **coords)


def cfg(model_type="qwen3", *, tie=False, heads=4, kv=2, layers=2, experts=0, vocab=100):
    out = dict(model_type=model_type, vocab_size=vocab, hidden_size=16, intermediate_size=32,
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
               head_dim=4, tie_word_embeddings=tie)
    if experts:
        out.update(num_experts=experts, moe_intermediate_size=8, decoder_sparse_step=1)
    return out


def globals_of(config):
    out, start = {}, 0
    for name, shape in hf_parameters(config).items():
        n = math.prod(shape)
        out[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(shape)
        start += n
    return out


def local_tensor(spec, full):
    t = torch.zeros(spec.local_shape, dtype=torch.float64)
    for p in spec.pieces:
        t[p.local_box.slices()] = full[p.name][p.global_box.slices()]
    return t


def find(specs, local_name):
    return next(s for s in specs if s.local_name == local_name)


def check_covers(config, rank_specs):
    """Every canonical element is held by exactly one replica-0 piece; local boxes tile."""
    full = globals_of(config)
    counts = {n: torch.zeros(t.shape, dtype=torch.int64) for n, t in full.items()}
    for specs in rank_specs:
        for spec in specs:
            cover = torch.zeros(spec.local_shape, dtype=torch.int64)
            for p in spec.pieces:
                cover[p.local_box.slices()] += 1
                if spec.replica == 0:
                    counts[p.name][p.global_box.slices()] += 1
            for box in spec.padding:
                cover[box.slices()] += 1
            assert bool((cover == 1).all()), f"{spec.local_name} local elements not tiled once"
    for name, c in counts.items():
        assert bool((c == 1).all()), f"{name}: replica-0 coverage {c.unique().tolist()}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_layouts_cover_every_element_once(family, tie, tp, pp):
    config = cfg(family, tie=tie, experts=4 if family == "qwen3_moe" else 0, kv=4)
    grid = [(t, p) for p in range(pp) for t in range(tp)]
    for build in (vllm_layout, megatron_layout, tp_layout):
        check_covers(config, [build(config, at(t, tp, pp_rank=p, pp_size=pp)) for t, p in grid])
    check_covers(config, [hf_layout(config, at(pp_rank=p, pp_size=pp), shard_rank=t,
                                    shard_size=tp) for t, p in grid])


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_moe_expert_parallel_layouts_cover(ep):
    config = cfg("qwen3_moe", experts=4)
    check_covers(config, [vllm_layout(config, at(ep_rank=e, ep_size=ep, dp_rank=e))
                          for e in range(ep)])
    check_covers(config, [megatron_layout(config, at(ep_rank=e, ep_size=ep, dp_rank=e),
                                          grouped_experts=True) for e in range(ep)])
    check_covers(config, [hf_layout(config, packed_experts=True, shard_rank=r, shard_size=ep)
                          for r in range(ep)])


def test_vllm_qkv_is_q_k_v_per_rank_and_replicates_kv_heads():
    config = cfg("llama", heads=8, kv=2)
    full = globals_of(config)
    a = "model.layers.0.self_attn."
    q, k, v = (full[f"{a}{x}_proj.weight"] for x in "qkv")
    for tp in (1, 2, 4):
        for r in range(tp):
            spec = find(vllm_layout(config, at(r, tp)), a + "qkv_proj.weight")
            if tp > 2:  # each kv head lives on tp/2 consecutive ranks
                head = r // (tp // 2)
                k_r, v_r = k[head * 4:(head + 1) * 4], v[head * 4:(head + 1) * 4]
            else:
                k_r, v_r = k.chunk(tp)[r], v.chunk(tp)[r]
            expected = torch.cat([q.chunk(tp)[r], k_r, v_r])
            assert torch.equal(local_tensor(spec, full), expected)
    reps = [find(vllm_layout(config, at(r, 4)), a + "qkv_proj.weight").replica for r in range(4)]
    assert reps[0] == 0 and reps[2] == 0 and reps[1] > 0 and reps[3] > 0


def test_megatron_qkv_interleaves_per_query_group():
    config = cfg("qwen2", heads=8, kv=2)
    full = globals_of(config)
    a = "model.layers.0.self_attn."
    for kind in ("weight", "bias"):
        q, k, v = (full[f"{a}{x}_proj.{kind}"] for x in "qkv")
        trailing = q.shape[1:]
        # Independent construction: view per query group, concatenate, flatten.
        expected = torch.cat([q.reshape(2, 4 * 4, *trailing), k.reshape(2, 4, *trailing),
                              v.reshape(2, 4, *trailing)], dim=1).reshape(-1, *trailing)
        for tp in (1, 2):
            name = f"decoder.layers.0.self_attention.linear_qkv.{kind}"
            parts = [local_tensor(find(megatron_layout(config, at(r, tp)), name), full)
                     for r in range(tp)]
            assert torch.equal(torch.cat(parts), expected)


def test_fused_gate_up_is_gate_then_up_per_rank():
    config = cfg("llama")
    full = globals_of(config)
    g, u = full["model.layers.1.mlp.gate_proj.weight"], full["model.layers.1.mlp.up_proj.weight"]
    for r in range(2):
        v = find(vllm_layout(config, at(r, 2)), "model.layers.1.mlp.gate_up_proj.weight")
        m = find(megatron_layout(config, at(r, 2)), "decoder.layers.1.mlp.linear_fc1.weight")
        expected = torch.cat([g.chunk(2)[r], u.chunk(2)[r]])
        assert torch.equal(local_tensor(v, full), expected)
        assert torch.equal(local_tensor(m, full), expected)


def test_vocab_padding_vllm_and_megatron():
    config = cfg("llama", vocab=100)
    heads = [find(vllm_layout(config, at(r, 2)), "lm_head.weight") for r in range(2)]
    assert [s.local_shape[0] for s in heads] == [64, 64]  # 100 padded to 128, split in two
    assert [box.sizes[0] for s in heads for box in s.padding] == [28]
    assert padded_vocab(100, 2) == 256
    first, second = (find(megatron_layout(config, at(r, 2)), "output_layer.weight")
                     for r in range(2))
    assert first.local_shape == second.local_shape == (128, 16)
    assert first.pieces[0].global_box.sizes[0] == 100 and first.padding[0].sizes[0] == 28
    assert second.pieces == () and second.padding[0].sizes[0] == 128


def test_tied_embeddings_have_no_head_unless_last_stage_is_separate():
    config = cfg("qwen3", tie=True)
    assert "lm_head.weight" not in hf_parameters(config)
    assert not any(s.local_name == "lm_head.weight" for s in vllm_layout(config))
    head = find(vllm_layout(config, at(pp_rank=1, pp_size=2)), "lm_head.weight")
    assert head.names == ("model.embed_tokens.weight",) and head.replica > 0


def test_fsdp_shards_follow_torch_chunk():
    config = cfg("llama", vocab=10)
    sizes = [find(hf_layout(config, shard_rank=r, shard_size=4), "model.embed_tokens.weight")
             .local_shape[0] for r in range(4)]
    chunks = [c.shape[0] for c in torch.zeros(10).chunk(4)]
    assert sizes == chunks + [0] * (4 - len(chunks))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_hf_layout_matches_real_transformers_module(family):
    transformers = pytest.importorskip("transformers")
    config = cfg(family, experts=4 if family == "qwen3_moe" else 0)
    hf_config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    packed = family == "qwen3_moe"
    specs = hf_layout(hf_config, packed_experts=packed)
    ours = {s.local_name: s.local_shape for s in specs}
    assert set(ours) == set(real)
    for name, shape in real.items():
        assert math.prod(ours[name]) == math.prod(shape) and ours[name][-1] == shape[-1], name
    if packed:  # the 2-D view holds expert e's gate then up rows at [e*2I, (e+1)*2I)
        full = globals_of(config)
        spec = find(specs, "model.layers.0.mlp.experts.gate_up_proj")
        view = local_tensor(spec, full).reshape(4, 16, 16)
        assert torch.equal(view[2, :8], full["model.layers.0.mlp.experts.2.gate_proj.weight"])
        assert torch.equal(view[2, 8:], full["model.layers.0.mlp.experts.2.up_proj.weight"])


def test_name_converters():
    config = cfg("qwen3_moe", experts=4)
    assert hf_to_vllm("model.layers.3.self_attn.k_proj.weight") == (
        "model.layers.3.self_attn.qkv_proj.weight", "k")
    assert hf_to_vllm("model.layers.0.mlp.experts.2.up_proj.weight") == (
        "model.layers.0.mlp.experts.routed_experts.w13_weight", ("w3", 2))
    assert hf_to_vllm("model.norm.weight") == ("model.norm.weight", None)
    assert vllm_to_hf("model.layers.1.self_attn.qkv_proj.weight", config) == tuple(
        f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv")
    assert megatron_to_hf("decoder.layers.0.self_attention.linear_qkv.weight", config,
                          coords=at(pp_rank=1, pp_size=2)) == tuple(
        f"model.layers.1.self_attn.{x}_proj.weight" for x in "qkv")
    assert hf_to_megatron("model.layers.1.post_attention_layernorm.weight", config,
                          coords=at(pp_rank=1, pp_size=2)) == (
        "decoder.layers.0.pre_mlp_layernorm.weight",)
    assert hf_to_megatron("model.layers.1.mlp.experts.3.down_proj.weight", config,
                          grouped_experts=True) == (
        "decoder.layers.1.mlp.experts.linear_fc2.weight3",)


def test_bad_degrees_name_the_fix():
    with pytest.raises(ConfigError, match=r"tp=3 does not divide the model's 4 attention heads"):
        vllm_layout(cfg("llama"), at(0, 3))
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        ModelShape.from_hf_config({"model_type": "gpt2"})
