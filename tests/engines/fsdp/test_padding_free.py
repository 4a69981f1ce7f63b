"""Padding-free micro-batches give the padded step: same log-probs, loss, gradient norm,
entropy and weights after one step (float32), for fsdp (one process and FSDP2 over two
gloo ranks) and deepspeed (ZeRO-3 over two ranks), on llama, qwen2 and qwen3, at T = 0.7,
with a loss mask, long-tailed answers and shared prompts. Equal log-probs also show that
no sample attends to another in the packed row (transformers confines attention from the
position ids, or from the shared-prompt mask)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engines.deepspeed.trainlib import build_model  # noqa: E402
from tests.helpers.gloo import run_script  # noqa: E402

TEMPERATURE = 0.7
#: Long-tailed answers: most short, two long; prompts of different lengths.
PROMPT_LENGTHS = [3, 7, 4, 9, 5, 3, 6, 8, 4, 5]
RESPONSE_LENGTHS = [2, 1, 5, 3, 40, 4, 2, 27, 1, 6]
#: Samples 0-3 answer one prompt, 4-5 another, the rest their own.
PROMPT_OF = [0, 0, 0, 0, 4, 4, 6, 7, 8, 9]
#: Small enough for several micro-batches in both layouts.
BUDGET = 64
WORKER = Path(__file__).with_name("padding_free_worker.py")


def make_batch(vocab: int):
    """The batch both layouts train on (the same on every call)."""
    from peerflow.batch import Batch, RaggedField

    g = torch.Generator().manual_seed(5)
    count = len(PROMPT_LENGTHS)
    batch = Batch(sample_id=torch.arange(count), group_id=torch.tensor(PROMPT_OF),
                  weight_version=torch.zeros(count, dtype=torch.int64))
    prompts = [torch.randint(2, vocab, (n,), generator=g) for n in PROMPT_LENGTHS]
    batch.set("prompt_ids", [prompts[k] for k in PROMPT_OF])
    batch.set("response_ids", [torch.randint(2, vocab, (n,), generator=g)
                               for n in RESPONSE_LENGTHS])
    offsets = batch.ragged("response_ids").offsets
    tokens = int(offsets[-1])
    mask = torch.rand(tokens, generator=g) < 0.7  # observation tokens left untrained
    mask[:2] = True
    batch.set("loss_mask", RaggedField(values=mask, offsets=offsets))
    batch.set("advantages", RaggedField(values=torch.randn(tokens, generator=g),
                                        offsets=offsets))
    batch.set("old_logprobs", RaggedField(values=-torch.rand(tokens, generator=g) * 3,
                                          offsets=offsets))
    return batch


def optim(padding_free: bool):
    from peerflow.engines import OptimSettings

    return OptimSettings(lr=1e-2, eps=1e-3, grad_clip=0.0, micro_batch_tokens=BUDGET,
                         padding_free=padding_free)


def one_step(engine, batch) -> dict:
    """Log-probs, then one PPO step: what both layouts must agree on."""
    from peerflow.algorithms.losses import PPOClip

    logprobs = engine.forward_logprobs(batch).values
    micros = engine.plan_micro_batches(batch)
    metrics = engine.train_step(batch, PPOClip())
    return {"logprobs": logprobs, "metrics": metrics,
            "rows": [tuple(m.inputs.input_ids.shape) for m in micros]}


def assert_same_step(padded: dict, packed: dict, weights: tuple[dict, dict]) -> None:
    torch.testing.assert_close(packed["logprobs"], padded["logprobs"], atol=2e-5, rtol=1e-5)
    for key in ("loss", "grad_norm", "entropy"):
        assert packed["metrics"][key] == pytest.approx(padded["metrics"][key], rel=1e-4), key
    assert packed["metrics"]["padded_tokens"] <= padded["metrics"]["padded_tokens"]
    assert set(weights[0]) == set(weights[1])
    for name, tensor in weights[1].items():
        torch.testing.assert_close(tensor, weights[0][name], atol=2e-5, rtol=0, msg=name)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_model(request, tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp(f"pf-{request.param}"), request.param,
                       tied=request.param != "qwen2")


@pytest.mark.parametrize("share_prompts", [True, False], ids=["shared", "own-rows"])
def test_fsdp_padding_free_step_equals_padded_step(family_model, share_prompts):
    from peerflow import ParallelLayout
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.engines import EngineContext

    context = EngineContext(model_path=family_model, layout=ParallelLayout(),
                            temperature=TEMPERATURE)
    results, weights = [], []
    for padding_free in (False, True):
        engine = FSDPTrainEngine(context, FSDPTrainOptions(share_prompts=share_prompts),
                                 optim(padding_free))
        assert engine.padding_free is padding_free
        batch = make_batch(engine.model.config.vocab_size)
        results.append(one_step(engine, batch))
        weights.append({n: p.detach().clone() for n, p in engine.model.named_parameters()})
    padded, packed = results
    assert all(rows == 1 for rows, _ in packed["rows"])  # one row per micro-batch
    if not share_prompts:  # no padding at all: every position is a real token
        assert packed["metrics"]["padded_tokens"] == int(batch.token_count().sum())
    assert_same_step(padded, packed, tuple(weights))


def test_packed_row_holds_samples_apart_by_position_ids():
    """The layout: one row, position ids restarting per sample, no mask to pass."""
    from peerflow.training.packing import packed_inputs

    batch = make_batch(50).select([0, 4, 8])
    inputs = packed_inputs(batch, share_prompts=False)
    lengths = batch.token_count().tolist()
    assert inputs.input_ids.shape == (1, sum(lengths))
    assert inputs.attention_mask_as(torch.float32) is None
    assert inputs.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    shared = packed_inputs(make_batch(50).select([0, 1, 2]), share_prompts=True)
    assert shared.input_ids.shape == (1, PROMPT_LENGTHS[0] + sum(RESPONSE_LENGTHS[:3]))
    assert shared.attention_mask_as(torch.float32).shape[-2:] == (shared.input_ids.shape[1],) * 2


def test_padding_free_true_refuses_an_attention_that_would_mix_samples(tmp_path):
    from peerflow.errors import ConfigError
    from peerflow.training.packing import resolve_padding_free

    model = torch.nn.Linear(1, 1)
    model.config = type("Config", (), {"_attn_implementation": "paged|custom"})()
    with pytest.raises(ConfigError, match="padding_free: auto"):
        resolve_padding_free(True, model, "fsdp")
    assert resolve_padding_free("auto", model, "fsdp") is False
    # auto: on where attention follows the samples, off under a dense mask; true forces it
    for backend, auto in (("flash_attention_2", True), ("flex_attention", True),
                          ("sdpa", False), ("eager", False)):
        model.config._attn_implementation = backend
        assert resolve_padding_free("auto", model, "fsdp") is auto, backend
        assert resolve_padding_free(True, model, "fsdp") is True
        assert resolve_padding_free(False, model, "fsdp") is False


@pytest.mark.parametrize("world", [2])
def test_fsdp2_and_zero3_padding_free_step_equals_padded_step(tmp_path, world):
    pytest.importorskip("deepspeed")
    model_path = build_model(tmp_path / "llama", "llama", tied=True)
    run_script(WORKER, model_path, str(tmp_path), nprocs=world)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name in ("fsdp", "deepspeed"):
            padded, packed = got[name]
            assert_same_step(padded, packed, (padded["weights"], packed["weights"]))
        # bf16 compute (fp32 reduction, CPU offload, checkpointing): the fp32 step, roughly
        controls, fp32 = got["fsdp_controls"]["metrics"], got["fsdp"][0]["metrics"]
        for key in ("loss", "grad_norm"):
            assert controls[key] == pytest.approx(fp32[key], rel=0.05), key


def test_critic_values_padding_free_equal_padded(tiny_model):
    from peerflow import ParallelLayout
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.engines import EngineContext

    context = EngineContext(model_path=tiny_model, layout=ParallelLayout())
    values = []
    for padding_free in (False, True):
        engine = FSDPTrainEngine(context, FSDPTrainOptions(value_head=True), optim(padding_free))
        torch.manual_seed(0)
        torch.nn.init.normal_(engine.model.score.weight)  # a zero head hides the backbone
        values.append(engine.forward_values(make_batch(engine.model.config.vocab_size)))
    torch.testing.assert_close(values[1].values, values[0].values, atol=2e-5, rtol=1e-5)


def test_activation_checkpointing_gives_the_same_step(tiny_model):
    import attrs

    from peerflow import ParallelLayout
    from peerflow.adapters.fsdp.engine import FSDPTrainEngine, FSDPTrainOptions
    from peerflow.engines import EngineContext

    context = EngineContext(model_path=tiny_model, layout=ParallelLayout(),
                            temperature=TEMPERATURE)
    steps = []
    for checkpointing in (False, True):
        settings = attrs.evolve(optim(True), activation_checkpointing=checkpointing)
        engine = FSDPTrainEngine(context, FSDPTrainOptions(), settings)
        assert engine.model.is_gradient_checkpointing is checkpointing
        steps.append(one_step(engine, make_batch(engine.model.config.vocab_size))["metrics"])
    for key in ("loss", "grad_norm", "entropy"):
        assert steps[1][key] == pytest.approx(steps[0][key], rel=1e-5), key


def test_megatron_pads_and_says_so(plugin_manager):
    from peerflow.adapters.megatron.engine import _say_padding
    from tests.helpers.configs import validation_error

    _say_padding(optim(True))  # only says so: what it cannot do is refused at validate
    message = validation_error(plugin_manager, "trainer.backend=megatron",
                               "trainer.padding_free=true",
                               "trainer.activation_checkpointing=true")
    assert "trainer.padding_free=true: trainer.backend='megatron' does not declare" in message
    assert "Fix: set trainer.padding_free: auto" in message
    assert "trainer.activation_checkpointing=true: trainer.backend='megatron'" in message


def test_padding_free_plan_budgets_real_tokens():
    from peerflow.training.microbatch import plan_micro_batches, split_to_count

    lengths = [300, 20, 5, 250, 40, 1000, 60]
    plan = plan_micro_batches(lengths, 400, packed=True)
    assert plan == [[5], [0, 6, 4], [3, 1, 2]]  # first fit, longest first; 1000 alone
    assert all(sum(lengths[i] for i in b) <= 400 for b in plan if len(b) > 1)
    more = split_to_count(plan, lengths, 4, packed=True)  # a rank with fewer splits the
    assert more == [[5], [0], [6, 4], [3, 1, 2]]  # most real tokens (400 > 275)
