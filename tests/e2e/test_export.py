"""`peerflow export` / `peerflow.export` on the shared 2-process fsdp run (its actor sharded
over both ranks; checkpoints at steps 2 and 4): the directory loads with transformers, and
its log-probs on answers sampled at T = 0.7 (ragged lengths) are the trainer's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import peerflow
from peerflow import GenerationRequest, ParallelLayout, SamplingParams
from peerflow.cli import main
from peerflow.engines import EngineContext
from tests.engines.deepspeed.trainlib import TEMPERATURE, hf_logprobs
from tests.engines.fsdp.fsdp_testlib import to_batch

pytestmark = pytest.mark.distributed

PROMPTS = ["958>", "12>", "4401>", "7>", "63>"]


def _source_model(run_dir) -> str:
    from peerflow.config import load_config
    from peerflow.plugins import get_plugin_manager
    from peerflow.worker.runtime import resolve_model_path

    return resolve_model_path(load_config(run_dir / "config.yaml"), get_plugin_manager())


def _sampled_batch(model_dir: str):
    """Two answers a prompt sampled at T = 0.7 by the hf rollout engine from `model_dir`."""
    from peerflow.adapters.hf.engine import HFRolloutEngine

    engine = HFRolloutEngine(EngineContext(model_path=model_dir, layout=ParallelLayout()))
    ids = [engine.tokenizer(p).input_ids for p in PROMPTS]
    requests = [GenerationRequest(request_id=i, prompt_ids=p) for i, p in enumerate(ids)]
    results = engine.generate(requests, SamplingParams(n=2, max_tokens=6, temperature=TEMPERATURE,
                                                       seed=5))
    return to_batch(requests, results)


def _trainer_logprobs(source: str, checkpoint, batch) -> torch.Tensor:
    """The fsdp trainer's log-probs with the checkpoint loaded (onto one rank)."""
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine
    from peerflow.engines import OptimSettings

    engine = FSDPTrainEngine(EngineContext(model_path=source, layout=ParallelLayout(),
                                           temperature=TEMPERATURE), None, OptimSettings())
    engine.load_checkpoint(str(checkpoint / "actor"))
    return engine.forward_logprobs(batch).values


def test_exported_model_loads_and_scores_like_the_trainer(quickstart_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = peerflow.export(quickstart_run, tmp_path / "model")  # newest verified: step 4
    info = json.loads((out / "peerflow_export.json").read_text())
    assert (info["step"], info["backend"], info["dtype"]) == (4, "fsdp", "float32")
    source = _source_model(quickstart_run)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer, original = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(source)
    assert tokenizer.chat_template and tokenizer.chat_template == original.chat_template
    assert tokenizer("958>").input_ids == original("958>").input_ids
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id

    batch = _sampled_batch(str(out))
    lengths = batch.lengths("response_ids").tolist()
    assert len(set(lengths)) > 1, f"answers of one length only: {lengths}"
    trainer = _trainer_logprobs(source, quickstart_run / "checkpoints" / "step_000004", batch)
    diff = (hf_logprobs(str(out), batch) - trainer).abs().max().item()
    assert diff < 1e-5, f"exported model's log-probs differ from the trainer's by {diff}"


def test_step_dtype_shards_and_errors(quickstart_run, tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "step2"
    args = ["export", str(quickstart_run), str(out), "--step", "2", "--dtype", "bfloat16",
            "--max-shard-size", "20000"]
    assert main(args) == 0
    assert "exported step 2" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "small --max-shard-size: several files"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    newest = peerflow.export(quickstart_run / "checkpoints" / "step_000004", tmp_path / "newest")
    step4 = load_file(str(newest / "model.safetensors"))
    assert any(not torch.equal(p.float(), step4[n].to(torch.bfloat16).float())
               for n, p in model.state_dict().items() if n in step4), "step 2 == step 4"

    def error(*args: str) -> str:
        assert main(["export", *args]) == 1
        return capsys.readouterr().err

    assert "is not an empty directory" in error(str(quickstart_run), str(out))
    assert "no checkpoint of step 3 (checkpoints: 2, 4)" in error(
        str(quickstart_run), str(tmp_path / "new"), "--step", "3")
    bare = tmp_path / "bare-run"
    bare.mkdir()
    shutil.copy(quickstart_run / "config.yaml", bare / "config.yaml")
    message = error(str(bare), str(tmp_path / "new"))
    assert "has no verified checkpoint" in message and "run.checkpoint_every" in message
    assert "not a run directory" in error(str(tmp_path), str(tmp_path / "new"))
    assert not (tmp_path / "new").exists(), "a failed export leaves nothing behind"
