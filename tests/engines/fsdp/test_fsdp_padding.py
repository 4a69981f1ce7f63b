"""Little padding, same step: the fsdp engine's length-cut micro-batches and response-only
vocabulary projection give the loss, gradient norm, entropy and weights of one padded
full-logits pass over the whole batch (the plain HF model, written out here)."""

from __future__ import annotations

import pytest
import torch

from peerflow import ParallelLayout
from peerflow.batch import Batch, RaggedField
from peerflow.engines import EngineContext, OptimSettings
from peerflow.training import pack_by_tokens, pad_inputs

TEMPERATURE = 0.7
#: Long-tailed answers (most short, two long) after prompts of different lengths.
PROMPT_LENGTHS = [3, 7, 4, 9, 5, 3, 6, 8]
RESPONSE_LENGTHS = [2, 1, 5, 3, 60, 4, 2, 37]
#: Small enough that the planner cuts the batch into several micro-batches.
BUDGET = 160
OPTIM = OptimSettings(lr=1e-2, eps=1e-3, grad_clip=0.0, micro_batch_tokens=BUDGET)


#: With shared prompts: samples 0-3 answer one prompt, 4-5 another, 6 and 7 their own.
SHARED_PROMPT_OF = [0, 0, 0, 0, 4, 4, 6, 7]


def _batch(vocab: int, shared: bool = False) -> Batch:
    g = torch.Generator().manual_seed(11)
    count = len(PROMPT_LENGTHS)
    batch = Batch(sample_id=torch.arange(count), group_id=torch.arange(count) // 2,
                  weight_version=torch.zeros(count, dtype=torch.int64))
    prompts = [torch.randint(2, vocab, (n,), generator=g) for n in PROMPT_LENGTHS]
    if shared:
        prompts = [prompts[k] for k in SHARED_PROMPT_OF]
    batch.set("prompt_ids", prompts)
    batch.set("response_ids", [torch.randint(2, vocab, (n,), generator=g)
                               for n in RESPONSE_LENGTHS])
    offsets = batch.ragged("response_ids").offsets
    tokens = int(offsets[-1])
    mask = torch.rand(tokens, generator=g) < 0.7  # agents: observation tokens untrained
    mask[:2] = True
    batch.set("loss_mask", RaggedField(values=mask, offsets=offsets))
    batch.set("advantages", RaggedField(values=torch.randn(tokens, generator=g),
                                        offsets=offsets))
    return batch


def _reference(model_path: str, batch: Batch, loss) -> dict:
    """One AdamW step of the plain HF model on the whole batch: one right-padded pass,
    logits at every position, `log_softmax(logits / T)` at the response tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    inputs = pad_inputs(batch)
    logits = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).logits
    assert logits.shape[1] == inputs.input_ids.shape[1]
    log_pi = torch.log_softmax(logits / TEMPERATURE, -1)
    width = inputs.input_ids.shape[1]
    picked, entropy = [], []
    for row, (start, count) in enumerate(zip(inputs.prompt_lengths.tolist(),
                                             inputs.response_lengths.tolist(), strict=True)):
        span = log_pi[row, start - 1:start - 1 + count]
        targets = inputs.input_ids[row, start:start + count]
        assert start + count <= width
        picked.append(span.gather(-1, targets[:, None])[:, 0])
        entropy.append(-(span.exp() * span).sum(-1))
    logprobs = RaggedField(values=torch.cat(picked), offsets=batch.ragged("response_ids").offsets)
    trained = batch.trained_lengths()
    value, _ = loss(logprobs, batch, global_tokens=int(trained.sum()),
                    global_samples=int((trained > 0).sum()))
    value.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
    torch.optim.AdamW(model.parameters(), lr=OPTIM.lr, eps=OPTIM.eps, weight_decay=0.0).step()
    mask = batch.loss_mask()
    return {"loss": float(value.detach()), "grad_norm": float(norm),
            "entropy": float(torch.cat(entropy).detach()[mask].mean()),
            "state": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("shared", [False, True], ids=["own-prompts", "shared-prompts"])
@pytest.mark.parametrize("family", ["tiny_model", "tiny_untied_qwen"])
def test_cut_micro_batches_and_kept_logits_give_the_full_pass_step(family, shared, request):
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.algorithms.losses import PPOClip

    model_path = request.getfixturevalue(family)
    engine = FSDPTrainEngine(EngineContext(model_path=model_path, layout=ParallelLayout(),
                                           temperature=TEMPERATURE),
                             FSDPTrainOptions(), OPTIM)
    batch = _batch(engine.model.config.vocab_size, shared)
    lengths = batch.token_count().tolist()
    plan = pack_by_tokens(lengths, BUDGET)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in plan)
    assert len(plan) > 1 and padded < len(lengths) * max(lengths)  # really cut, less padding
    micros = engine.plan_micro_batches(batch)
    assert micros[0].inputs.logits_to_keep < micros[0].inputs.input_ids.shape[1]
    positions = sum(m.inputs.input_ids.shape[0] for m in micros)  # rows of all passes
    assert positions < len(batch) if shared else positions == len(batch)

    ref = _reference(model_path, batch, PPOClip())
    metrics = engine.train_step(batch, PPOClip())
    assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert metrics["entropy"] == pytest.approx(ref["entropy"], rel=1e-5)
    got = {n: p.detach() for n, p in engine.model.named_parameters()}
    assert set(got) == set(ref["state"])
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, ref["state"][name], atol=2e-5, rtol=0, msg=name)


@pytest.mark.parametrize("shared", [False, True], ids=["own-prompts", "shared-prompts"])
def test_logprobs_of_kept_positions_equal_the_full_pass(tiny_model, shared):
    from transformers import AutoModelForCausalLM

    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions

    engine = FSDPTrainEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout(),
                                           temperature=TEMPERATURE),
                             FSDPTrainOptions(), OPTIM)
    batch = _batch(engine.model.config.vocab_size, shared)
    got = engine.forward_logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for row in range(len(batch)):
        prompt = batch.ragged("prompt_ids").row(row)
        response = batch.ragged("response_ids").row(row)
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, response[:, None])[:, 0]
        torch.testing.assert_close(got.row(row), expected, atol=1e-5, rtol=1e-5)
