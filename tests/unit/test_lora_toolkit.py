"""LoRA (`trainer.lora`): config, validation, the fsdp trainer, the hf rollout, adapter sync.

One process, the tiny Llama and Qwen2 of the engine tests, temperature 0.7.
"""

from __future__ import annotations

import pytest
import torch

from peerflow import GenerationRequest, ParallelLayout, SamplingParams
from peerflow.config import load_config, validate_config
from peerflow.engines import EngineContext, OptimSettings
from peerflow.engines.lora import LoraConfig
from peerflow.errors import ConfigError
from tests.engines.fsdp.fsdp_testlib import PROMPTS, make_batch, nll_loss, to_batch
from tests.helpers.configs import validation_error

pytest.importorskip("peft")
LORA = LoraConfig(rank=4, alpha=16.0, target_modules=["q_proj", "v_proj", "down_proj"])
T = 0.7


def _trainer(path: str, lora: LoraConfig | None = LORA, lr: float = 5e-2):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine

    context = EngineContext(model_path=path, layout=ParallelLayout(), lora=lora, temperature=T)
    return FSDPTrainEngine(context, None, OptimSettings(lr=lr))


def _rollout(path: str, lora: LoraConfig | None = LORA):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    return HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout(), lora=lora))


@pytest.fixture(scope="module", params=["tiny_model", "tiny_untied_qwen"])
def model(request) -> str:
    return request.getfixturevalue(request.param)


def test_config_parses_and_refuses_bad_values():
    config = load_config(None, ["trainer.lora.rank=8", "trainer.lora.target_modules=[q_proj]"])
    assert config.trainer.lora == LoraConfig(rank=8, target_modules=["q_proj"])
    assert config.trainer.lora.scaling == 4.0
    assert load_config(None, []).trainer.lora is None
    with pytest.raises(ConfigError, match="all-linear"):
        load_config(None, ["trainer.lora.target_modules=linear"])
    with pytest.raises(ConfigError, match="trainer.lora.*'rank' must be >= 1: 0"):
        load_config(None, ["trainer.lora.rank=0"])


def test_validate_refuses_engines_without_the_capability(plugin_manager):
    message = validation_error(plugin_manager, "trainer.lora.rank=4", "trainer.backend=megatron")
    assert "trainer.lora: trainer.backend='megatron' does not declare Capabilities.lora" \
        in message
    assert "megatron-core 0.16 has no LoRA" in message
    assert "use trainer.backend deepspeed or fsdp" in message
    message = validation_error(plugin_manager, "trainer.lora.rank=4", "rollout.backend=sglang")
    assert "rollout.backend='sglang' does not declare Capabilities.lora" in message
    validate_config(load_config(None, ["trainer.lora.rank=4"]), plugin_manager)


def test_wrong_target_module_names_the_model_layers(tiny_model):
    with pytest.raises(ConfigError, match=r"matches no module.*q_proj"):
        _trainer(tiny_model, LoraConfig(target_modules=["query"]))


def test_trains_adapters_only_and_the_reference_is_the_base(model):
    from peerflow.training.lora import BaseModelView

    batch = make_batch(model)[0]
    base = _trainer(model, lora=None).forward_logprobs(batch).values
    engine = _trainer(model)
    frozen = {n: p.detach().clone() for n, p in engine.model.named_parameters()
              if not p.requires_grad}
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    names = [s.local_name for s in engine.weight_sources()]
    assert len(names) == 2 * 3 * 2  # A and B, 3 modules, 2 layers: nothing else syncs
    assert all(n.startswith("base_model.model.") and n.endswith(("lora_A.weight",
               "lora_B.weight")) for n in names)
    reference = BaseModelView(engine)
    torch.testing.assert_close(engine.forward_logprobs(batch).values, base)  # B starts at 0
    for _ in range(2):
        engine.train_step(batch, nll_loss)
    # optimiser state for the adapters only; the base weights did not move
    state = engine.optimizer.state
    assert len(state) == len(trainable) and all(p.requires_grad for p in state)
    for n, p in engine.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    assert torch.equal(reference.forward_logprobs(batch).values, base)
    adapted = engine.forward_logprobs(batch).values
    assert (adapted - base).abs().max() > 1e-3


def test_adapter_sync_reaches_the_rollout_exactly(model):
    from peerflow.reshard.service import WeightSyncService

    engine = _trainer(model)
    batch = make_batch(model)[0]
    engine.train_step(batch, nll_loss)
    rollout = _rollout(model)
    service = WeightSyncService.build(engine, rollout)
    stats = service.sync(engine.version)
    adapters = dict(engine._named_params())
    assert stats.bytes == sum(p.numel() * p.element_size() for p in adapters.values())
    full = sum(p.numel() * p.element_size() for p in _rollout(model, None).model.parameters())
    assert stats.bytes < full / 4
    received = dict(rollout._params)
    assert received.keys() == adapters.keys()
    for name, tensor in adapters.items():
        assert torch.equal(received[name], tensor), name  # bit-exact
    # the rollout samples from the adapted policy: its log-probs are the trainer's at T
    tok = rollout.tokenizer
    requests = [GenerationRequest(request_id=i, prompt_ids=tok(p).input_ids)
                for i, p in enumerate(PROMPTS)]
    results = rollout.generate(requests, SamplingParams(n=2, max_tokens=8, temperature=T,
                                                        seed=5))
    sampled = torch.cat([torch.tensor(r.logprobs) for r in results])
    scored = engine.forward_logprobs(to_batch(requests, results)).values
    torch.testing.assert_close(scored, sampled, atol=1e-4, rtol=0)


def test_checkpoint_holds_adapters_and_refuses_another_base(tmp_path, tiny_model):
    from safetensors import safe_open

    from tests.engines.hf.tiny_models import build_tiny_model

    engine = _trainer(tiny_model)
    batch = make_batch(tiny_model)[0]
    engine.train_step(batch, nll_loss)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    with safe_open(str(tmp_path / "ckpt" / "model-rank0.safetensors"), "pt") as saved:
        assert sorted(saved.keys()) == sorted(n for n, _ in engine._named_params())
    resumed = _trainer(tiny_model)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    for (name, a), (_, b) in zip(engine._named_params(), resumed._named_params(), strict=True):
        assert torch.equal(a, b), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    with pytest.raises(ConfigError, match="another base model"):
        _trainer(other).load_checkpoint(str(tmp_path / "ckpt"))



def test_resume_refuses_other_adapters(tmp_path):
    from peerflow.checkpoint.fingerprint import check_resume, write_fingerprint

    write_fingerprint(tmp_path, load_config(None, ["trainer.lora.rank=4"]))
    check_resume(tmp_path, load_config(None, ["trainer.lora.rank=4", "trainer.lr=0.1"]))
    for other in (["trainer.lora.rank=8"], []):
        with pytest.raises(ConfigError, match="trainer.lora"):
            check_resume(tmp_path, load_config(None, other))
