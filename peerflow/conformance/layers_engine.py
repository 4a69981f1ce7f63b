"""Layers 3–4 of the conformance suite: the real engine on CPU, then GPU-only checks.

Train adapters' layer 3 lives here, rollout adapters' in `layer3_rollout`.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.conformance.base import SuiteBase, check_family
from peerflow.conformance.checks import compare, round_trip
from peerflow.conformance.engines import as_declared, build_engine, read_weights
from peerflow.conformance.layers import fail_listing
from peerflow.conformance.models import ENGINE_MODELS, LAYOUT_MODELS, hf_config, write_checkpoint
from peerflow.conformance.oracle import shard_all
from peerflow.conformance.reference import (
    TensorSink,
    load_checkpoint_tensors,
    reference_logprobs,
)
from peerflow.conformance.tolerance import derive, worst_gap
from peerflow.conformance.train_diagnose import temperature_hint
from peerflow.layout import ParallelLayout
from peerflow.models import hf_parameters
from peerflow.reshard import sync_weights

layer3 = pytest.mark.peerflow_layer(3)
layer4 = pytest.mark.peerflow_layer(4)

_CHECKPOINTS: dict[str, str] = {}

#: Fixed prompts (token ids of the suite's character tokenizer).
PROMPTS = ((2, 3, 4, 5, 6), (14, 15, 16), (40, 20, 30, 10))


def specs_equal(declared: list, actual: list, what: str) -> None:
    """Fails listing every difference between declared and live specs."""
    want = {s.local_name: s for s in declared}
    have = {s.local_name: s for s in actual}
    problems = [f"{n}: declared by shard_layout but not by the engine"
                for n in want.keys() - have.keys()]
    problems += [f"{n}: held by the engine but not declared" for n in have.keys() - want.keys()]
    problems += [f"{n}: engine says {have[n]}, shard_layout says {want[n]}"
                 for n in want.keys() & have.keys() if want[n] != have[n]]
    fail_listing(sorted(problems), what)


def checkpoint_of(model_id: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny checkpoint (weights + tokenizer) of `ENGINE_MODELS[model_id]`, written once."""
    if model_id not in _CHECKPOINTS:
        _CHECKPOINTS[model_id] = write_checkpoint(
            ENGINE_MODELS[model_id], tmp_path_factory.mktemp(f"model-{model_id}"))
    return _CHECKPOINTS[model_id]


def buildable(profile, model_id: str, request: pytest.FixtureRequest) -> None:
    """Skips, saying why, where this machine cannot build the adapter on `model_id`."""
    check_family(profile, model_id)
    if profile.cls.capabilities.gpu_only and not torch.cuda.is_available():
        request.node.user_properties.append(("capability", "gpu_only"))
        pytest.skip(f"{profile.name} declares Capabilities.gpu_only and no CUDA device "
                    "is visible; layer 3 runs in layer 4 on a GPU machine")
    missing = profile.cls.missing_requirements()
    if missing:
        pytest.skip(f"{profile.name} needs {missing}: {profile.cls.install_hint}")


class EngineLayerBase(SuiteBase):
    """Fixtures of layer 3: a tiny checkpoint, a one-rank engine, the declared specs."""

    @pytest.fixture
    def model_dir(self, engine_model, tmp_path_factory):
        """A tiny checkpoint (weights + tokenizer) of `engine_model`, written once."""
        return checkpoint_of(engine_model, tmp_path_factory)

    @pytest.fixture
    def engine(self, profile, engine_model, model_dir, request):
        """A one-rank engine of the adapter on the tiny checkpoint, on this rank's device."""
        buildable(profile, engine_model, request)
        engine = build_engine(profile, model_dir)
        yield engine
        engine.shutdown()

    def declared(self, profile, engine_model):
        """The adapter's `shard_layout` for one rank of the single layout."""
        if profile.hook("shard_layout") is None:
            pytest.skip(f"{profile.name} defines no shard_layout classmethod")
        return list(profile.shard_layout(hf_config(ENGINE_MODELS[engine_model]),
                                         ParallelLayout(), 0, dtype="float32"))


class Layer3TrainEngine(EngineLayerBase):
    """Layer 3 for train adapters: export through the adapter against the checkpoint."""

    @layer3
    def test_l3_declared_layout_matches_engine(self, profile, engine, engine_model):
        """`weight_sources()` of a real engine equals the declared `shard_layout`."""
        specs_equal(self.declared(profile, engine_model), list(engine.weight_sources()),
                     f"{profile.name} {engine_model} weight_sources")

    @layer3
    def test_l3_weights_live_on_the_context_device(self, profile, engine):
        """Every weight the engine holds is on `EngineContext.device`, where it computes.

        On an accelerator (or the emulated one of `peerflow.testing`) a weight left on
        the host, or placed by the framework on another device, is the host/device mix
        that fails the first step.
        """
        want = torch.device(engine.context.device)
        wrong = sorted(f"{name} on {tensor.device}"
                       for name, tensor in read_weights(profile, engine).items()
                       if tensor.device.type != want.type
                       or want.index not in (None, tensor.device.index))
        fail_listing(wrong, f"{profile.name} weights not on EngineContext.device={want}")

    @layer3
    def test_l3_export_is_bit_exact(self, profile, engine, engine_model, model_dir):
        """A sync out of the engine reproduces the checkpoint on disk bit-exact."""
        config = hf_config(ENGINE_MODELS[engine_model])
        shapes = hf_parameters(config)
        sink = TensorSink(shapes)
        sync_weights(engine, sink, version=1, bucket_bytes=1 << 16)
        disk = load_checkpoint_tensors(model_dir)
        specs = {0: sink.specs}
        fail_listing(compare(shard_all(specs, disk), {0: sink.tensors}, specs),
                     f"{profile.name} {engine_model} export vs checkpoint")

    @layer3
    def test_l3_declared_shards_match_engine_memory(self, profile, engine, engine_model,
                                                    model_dir):
        """The engine's own tensors (read around the adapter) are what the specs say."""
        specs = list(engine.weight_sources())
        disk = load_checkpoint_tensors(model_dir)
        got = {0: as_declared(read_weights(profile, engine), specs)}
        fail_listing(compare(shard_all({0: specs}, disk), got, {0: specs}, check_padding=False),
                     f"{profile.name} {engine_model} memory vs declared shards")

    @layer3
    @pytest.mark.parametrize("temperature", (1.0, 0.7), ids=lambda t: f"T{t}")
    def test_l3_logprobs_match_reference(self, profile, engine, engine_model, model_dir,
                                         logprob_atol, temperature):
        """`forward_logprobs` is `log_softmax(logits / T)` of a plain HF model.

        T is `EngineContext.temperature` (the run's sampling temperature), 1 and 0.7.
        """
        engine.context = attrs.evolve(engine.context, temperature=temperature)
        config = hf_config(ENGINE_MODELS[engine_model])
        rows = [(p, tuple(reversed(p))) for p in PROMPTS]
        n = len(rows)
        batch = Batch(sample_id=torch.arange(n), group_id=torch.arange(n),
                      weight_version=torch.zeros(n, dtype=torch.int64), fields={
                          "prompt_ids": RaggedField.from_tensors(
                              [torch.tensor(p) for p, _ in rows]),
                          "response_ids": RaggedField.from_tensors(
                              [torch.tensor(r) for _, r in rows])})
        got = engine.forward_logprobs(batch).rows()
        tensors = load_checkpoint_tensors(model_dir)
        want, tolerance = derive(lambda dtype, attn: reference_logprobs(
            config, tensors, rows, temperature, dtype=dtype, attn_implementation=attn),
            logprob_atol)
        worst = worst_gap(got, want)
        if worst <= tolerance.atol:
            return
        gaps = {name: worst_gap(got, reference_logprobs(config, tensors, rows, t,
                                                        dtype=torch.float64))
                for name, t in (("untempered", 1.0), ("twice", temperature ** 2))
                if temperature != 1.0}
        pytest.fail(f"log-probs differ from log_softmax(logits / {temperature}) of the "
                    f"reference model by {worst:.2e} > {tolerance.explain()}: "
                    f"{temperature_hint(gaps, tolerance.atol, temperature, profile.cls)}",
                    pytrace=False)


class Layer4Gpu(SuiteBase):
    """Layer 4: GPU-only checks (marked `gpu`; skipped without CUDA)."""

    @layer4
    @pytest.mark.gpu
    def test_l4_cuda_reshard_matches_oracle(self, profile, layout_model, request):
        """Canonical → tp2 (or single) layout reshard with buffers on the GPU."""
        if not torch.cuda.is_available():
            pytest.skip("layer 4 needs a CUDA device")
        from peerflow.conformance.base import specs_or_skip
        from peerflow.conformance.checks import canonical_specs

        layout = ParallelLayout(tp=2) if profile.cls.capabilities.tensor_parallel \
            else ParallelLayout()
        canonical = hf_parameters(hf_config(LAYOUT_MODELS[layout_model]))
        specs = specs_or_skip(profile, layout_model, layout)
        src, dst = (specs, canonical_specs(canonical)) if profile.kind == "train" else \
            (canonical_specs(canonical), specs)
        fail_listing(round_trip(src, dst, canonical, device="cuda"), f"{profile.name} on CUDA")
