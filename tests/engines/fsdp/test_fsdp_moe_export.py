"""`peerflow export`'s writer on MoE checkpoints: an fsdp checkpoint of a trained tiny MoE
(module names, packed experts) becomes a Hugging Face directory under the checkpoint names
`save_pretrained` writes (experts one by one), which `from_pretrained` loads to the same
logits."""

from __future__ import annotations

import pytest
import torch

from peerflow import GenerationRequest, ParallelLayout, SamplingParams
from peerflow.engines import EngineContext, OptimSettings
from tests.engines.fsdp.fsdp_testlib import nll_loss, to_batch

#: An expert tensor of layer 1 under each family's checkpoint name.
EXPERT = {"qwen3_moe": "model.layers.1.mlp.experts.3.up_proj.weight",
          "mixtral": "model.layers.1.block_sparse_moe.experts.3.w3.weight",
          "gpt_oss": "model.layers.1.mlp.experts.gate_up_proj"}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_fsdp_moe_checkpoint_exports_checkpoint_names_that_transformers_loads(arch, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.hf_export import assemble_hf_tensors, write_model_dir
    from peerflow.models import hf_parameters
    from tests.engines.hf.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "model", arch=arch, num_experts=4, top_k=2, seed=5)
    rollout = HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout()))
    requests = [GenerationRequest(request_id=i, prompt_ids=rollout.tokenizer(p).input_ids)
                for i, p in enumerate(["12+3=", "abc"])]
    results = rollout.generate(requests, SamplingParams(n=2, max_tokens=6, seed=1))
    trainer = FSDPTrainEngine(EngineContext(model_path=path, layout=ParallelLayout()),
                              optim=OptimSettings(lr=1e-2))
    trainer.train_step(to_batch(requests, results), nll_loss)  # weights leave the source's
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    shards = FSDPTrainEngine.saved_shards(str(tmp_path / "ckpt"), model_path=path)
    out = write_model_dir(tmp_path / "export", assemble_hf_tensors(shards),
                          config=AutoConfig.from_pretrained(path),
                          tokenizer=AutoTokenizer.from_pretrained(path))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(hf_parameters(AutoConfig.from_pretrained(path)))
        assert EXPERT[arch] in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([rollout.tokenizer("12+3=abc hello").input_ids])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
    source = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.equal(source(input_ids=ids).logits, want)  # the trained weights
