"""Shared by the DeepSpeed and Megatron engine tests: tiny models, batches, reference step.

The reference is one optimiser step of the plain HF model in one process on the whole
batch; multi-rank engines must reproduce its log-probs, gradient norm and new weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

#: Adam with eps=1e-3 makes the post-step comparison about gradients, not about the
#: float noise of near-zero gradients (see tests/engines/fsdp).
#: A linear decay over 4 optimiser steps: the first step runs at `lr` (the one-process
#: reference's), the checkpoint round trip must continue the schedule (`SCHEDULE_LRS`).
OPTIM = {"lr": 0.01, "eps": 1e-3, "grad_clip": 0.0, "micro_batch_tokens": 24,
         "lr_schedule": "linear", "total_steps": 4}
#: The rates of steps 1, 2, 2 again after loading the step-1 checkpoint, and 3.
SCHEDULE_LRS = (0.01, 0.0075, 0.0075, 0.005)
SAMPLES = 8
#: Sampling temperature the engines score at (not 1, so a missing division shows).
TEMPERATURE = 0.7


def build_model(directory: Path | str, family: str = "llama", *, tied: bool = True) -> str:
    """Writes a random tiny HF causal LM (hidden 32, 2 layers, 4 heads, 2 kv heads)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    extra = {"head_dim": 8} if family == "qwen3" else {}
    config = cls(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 tie_word_embeddings=tied, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5)  # norms (and biases) away from their init
            else:
                param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return str(directory)


def one_layer_copy(model_path: str, out_dir: str) -> str:
    """The same model with one decoder layer instead of two (rank 0 writes; all ranks call)."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.join(out_dir, "one-layer")
    if dist.get_rank() == 0:
        config = AutoConfig.from_pretrained(model_path)
        config.num_hidden_layers = 1
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
    dist.barrier()
    return path


def refused_load(engine, directory: str) -> str | None:
    """`engine.load_checkpoint(directory)`'s `ConfigError` message (None: it loaded)."""
    from peerflow.errors import ConfigError

    try:
        engine.load_checkpoint(directory)
    except ConfigError as exc:
        return str(exc)
    return None


def full_batch():
    """Eight samples of ragged prompt/response lengths (the same on every call), the two
    answers of a group sharing their prompt, with a `loss_mask` that leaves some response
    tokens untrained."""
    from peerflow.batch import Batch, RaggedField

    g = torch.Generator().manual_seed(1)
    groups = [torch.randint(1, 61, (2 + i % 3,), generator=g) for i in range(SAMPLES // 2)]
    prompts = [groups[i // 2] for i in range(SAMPLES)]
    responses = [torch.randint(1, 61, (1 + (i * 5) % 4,), generator=g) for i in range(SAMPLES)]
    batch = Batch(sample_id=torch.arange(SAMPLES), group_id=torch.arange(SAMPLES) // 2,
                  weight_version=torch.zeros(SAMPLES))
    batch.set("prompt_ids", prompts)
    batch.set("response_ids", responses)
    # agents' loss mask: every third response token (an observation) is not trained
    offsets = batch.ragged("response_ids").offsets
    batch.set("loss_mask", RaggedField(values=torch.arange(int(offsets[-1])) % 3 != 2,
                                       offsets=offsets))
    return batch


def dp_slice(batch, dp_rank: int, dp_size: int):
    """The samples of one dp rank (uneven on purpose: rank 0 gets 5 of 8 with dp=2)."""
    if dp_size == 1:
        return batch
    cut = 5
    return batch.select(range(cut) if dp_rank == 0 else range(cut, len(batch)))


def start_gloo_rank(**context_options):
    """A worker script's start: `sys.argv` = MODEL_DIR OUT_DIR, gloo, this rank's batch.

    Returns:
        `(model_path, out_dir, rank, world, batch, context)`: the context is dp=world on
        this rank at `TEMPERATURE`, with `context_options` (e.g. `lora=`) added.
    """
    import sys

    import torch.distributed as dist

    from peerflow.engines import EngineContext
    from peerflow.layout import ParallelLayout

    torch.set_num_threads(1)
    model_path, out_dir = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    context = EngineContext(model_path=model_path, layout=ParallelLayout(dp=world), rank=rank,
                            temperature=TEMPERATURE, **context_options)
    return model_path, out_dir, rank, world, dp_slice(full_batch(), rank, world), context


def nll_loss(logprobs, batch, *, global_tokens, global_samples):
    """Token-mean negative log-likelihood of the trained tokens (`loss_mask`), normalised
    by the global trained-token count."""
    mask = batch.loss_mask()
    value = -logprobs.values[mask].sum() / global_tokens
    return value, {"nll": float(value.detach()) * global_tokens}


def reference(model_path: str) -> dict:
    """Log-probs at `TEMPERATURE`, loss, entropy, gradient norm and post-step HF state of one
    AdamW step."""
    from transformers import AutoModelForCausalLM

    from peerflow.training import pad_inputs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    batch = full_batch()
    inputs = pad_inputs(batch)
    out = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                position_ids=inputs.position_ids)
    # log_softmax(logits / T)[target], written out here rather than through the toolkit
    log_pi = torch.log_softmax(out.logits / TEMPERATURE, -1)
    logprobs = inputs.gather(log_pi.gather(-1, inputs.target_ids[..., None])[..., 0])
    mask = batch.loss_mask()
    entropy = inputs.gather(-(log_pi.exp() * log_pi).sum(-1)).values[mask].mean()
    loss = -logprobs.values[mask].sum() / mask.sum()
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    optim = torch.optim.AdamW(model.parameters(), lr=OPTIM["lr"], eps=OPTIM["eps"],
                              weight_decay=0.0)
    optim.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if "lm_head.weight" in state and model.config.tie_word_embeddings:
        del state["lm_head.weight"]
    return {"logprobs": logprobs.values.detach(), "grad_norm": float(norm), "state": state,
            "loss": float(loss.detach()), "entropy": float(entropy.detach())}


def assert_step_matches(metrics: dict, ref: dict) -> None:
    """A rank's train-step `metrics` are the `reference` step's: gradient norm (to 1e-4),
    loss and entropy (to 1e-5, relative)."""
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert metrics["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)


def hf_logprobs(model_dir: str, batch) -> torch.Tensor:
    """Log-probs at `TEMPERATURE` of `batch`'s responses under the HF model in `model_dir`
    (loaded with `AutoModelForCausalLM.from_pretrained`, as saved)."""
    from transformers import AutoModelForCausalLM

    from peerflow.training import pad_inputs

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = pad_inputs(batch)
    with torch.no_grad():
        logits = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                       position_ids=inputs.position_ids).logits.float()
    log_pi = torch.log_softmax(logits / TEMPERATURE, -1)
    return inputs.gather(log_pi.gather(-1, inputs.target_ids[..., None])[..., 0]).values


def export_checkpoint(engine_cls, ckpt: str, model_path: str, out_dir: str, **options) -> str:
    """Writes an engine checkpoint as a HF model directory the way `peerflow export` does
    (the adapter's `saved_shards`, assembled, written with the source model's config)."""
    from transformers import AutoConfig

    from peerflow.hf_export import assemble_hf_tensors, write_model_dir

    shards = engine_cls.saved_shards(ckpt, model_path=model_path,
                                     options=engine_cls.options_class(**options))
    write_model_dir(out_dir, assemble_hf_tensors(shards),
                    config=AutoConfig.from_pretrained(model_path))
    return out_dir


def optim_settings():
    """The `OptimSettings` the workers use."""
    from peerflow.engines import OptimSettings

    return OptimSettings(**OPTIM)


def dumps(value: object) -> str:
    """JSON for worker arguments."""
    return json.dumps(value)
