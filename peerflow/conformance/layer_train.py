"""The train layer (layer 3, `-k l3_train`): a train engine trains as the contract says.

On the fixed RL batch of `train_reference` (two prompts × four ragged answers, T = 0.7,
advantages of both signs, stale old log-probs, two mini-batches of several
micro-batches), for every train engine:

* one `train_step` at dp = 1 and at dp = 2 (two spawned processes) gives the loss, the
  gradient norm before clipping and the updated weights of a plain autograd + AdamW
  reference, within tolerances derived from the reference's own float32 spread;
* at dp = 2 the replicas hold identical weights after the step, and every rank's
  `weight_sources()` names the model's HF tensors (a wrapper's `module.` prefix fails);
* with `shares_prompts`, rows that share a prompt score as the same samples unshared;
* with `Capabilities.checkpoint`, `save_checkpoint` → a fresh engine → `load_checkpoint`
  restores `version`, gives the same log-probs and the same next step as the engine that
  never stopped, and `saved_shards` (what `peerflow export` reads) is the live weights.

Each failure names the likely cause and the author's method (`train_diagnose`).
"""

from __future__ import annotations

import pytest
import torch

from peerflow.conformance.base import needs
from peerflow.conformance.layers import fail_listing
from peerflow.conformance.layers_engine import EngineLayerBase, buildable, checkpoint_of
from peerflow.conformance.models import ENGINE_MODELS, hf_config
from peerflow.conformance.oracle import assemble
from peerflow.conformance.reference import load_checkpoint_tensors, reference_logprobs
from peerflow.conformance.tolerance import derive, worst_gap
from peerflow.conformance.train_diagnose import grad_norm_hint, name_problems, own_method
from peerflow.conformance.train_ranks import (
    RankResult,
    exported,
    run_two_ranks,
    step_here,
    train_engine,
)
from peerflow.conformance.train_reference import (
    TEMPERATURE,
    derive_step,
    rows,
    train_batch,
    train_loss,
    weight_gap,
)
from peerflow.models import hf_parameters

layer3 = pytest.mark.peerflow_layer(3)

#: Dense models the layer trains: tied and untied heads.
TRAIN_MODELS = ("llama-tied", "qwen2-untied")
_REFERENCES: dict[str, tuple] = {}


def reference_of(model_id: str, model_dir: str) -> tuple:
    """`(batch, float64 step, tolerance)` of a model, derived once per session."""
    if model_id not in _REFERENCES:
        from peerflow.distributed.devices import rank_device

        rank_device()  # decided before the reference's backward (an emulated device installs then)
        config = hf_config(ENGINE_MODELS[model_id])
        tensors = load_checkpoint_tensors(model_dir)
        batch = train_batch(config, tensors)
        _REFERENCES[model_id] = (batch, *derive_step(config, tensors, batch))
    return _REFERENCES[model_id]


def replica_problems(results: list[RankResult], full: dict[str, torch.Tensor]) -> list[str]:
    """Regions where a rank's exported values differ from the replica-0 holder's."""
    problems = []
    for result in results:
        for spec in result.specs:
            local = result.tensors[spec.local_name].double()
            for piece in spec.pieces:
                want = full[piece.name][piece.global_box.slices()]
                have = local[piece.local_box.slices()]
                if not torch.equal(have, want):
                    problems.append(
                        f"rank {result.rank} holds {piece.name} {piece.global_box} off the "
                        f"replica-0 copy by {float((have - want).abs().max()):.2e} after one "
                        "step: the dp-ranks' replicas diverge (gradients are not synchronised "
                        "over the dp group — no all-reduce, or DDP's no_sync left on)")
                    break
    return problems


def step_problems(results: list[RankResult], truth, tolerance, cls: type) -> list[str]:
    """Everything a step on `len(results)` dp-ranks got wrong against the reference."""
    dp = len(results)
    config_names = truth.weights
    problems = []
    for r in results:
        if r.version != 1:
            problems.append(f"rank {r.rank}: version is {r.version} after one train_step "
                            "(train_step increments version once per call)")
    for key in ("loss", "grad_norm"):
        values = [r.metrics.get(key, float("nan")) for r in results]
        if len(set(values)) > 1:
            problems.append(f"{key} differs between dp-ranks: {values} (the contract reports "
                            "it summed over the dp group, the same on every rank)")
        got, want = values[0], getattr(truth, key)
        if not abs(got - want) <= getattr(tolerance, key):
            hint = grad_norm_hint(got, want, dp=dp, cls=cls) if key == "grad_norm" else ""
            problems.append(f"{key} {got:.6g} at dp={dp}, the reference's {want:.6g} "
                            f"({tolerance.explain(key)}).{hint}")
    full = assemble({r.rank: r.specs for r in results}, {r.rank: r.tensors for r in results})
    problems += replica_problems(results, full)
    gap = weight_gap(full, config_names)
    if gap > tolerance.weights:
        worst = max(full.keys() & config_names.keys(),
                    key=lambda n: float((full[n] - config_names[n]).abs().max()))
        problems.append(f"the weights after the step differ from the reference's by {gap:.2e} "
                        f"(worst {worst}; {tolerance.explain('weights')})")
    return problems


class LayerTrain(EngineLayerBase):
    """The train layer: `train_step` against the reference, dp = 2, shared prompts, resume."""

    @pytest.fixture(params=TRAIN_MODELS)
    def train_model(self, request, profile):
        """A dense model the layer trains (skipped where the adapter cannot build)."""
        buildable(profile, request.param, request)
        return request.param

    @pytest.fixture(params=TRAIN_MODELS[:1])
    def first_model(self, request, profile):
        """The model the two-process and checkpoint tests train (the first of TRAIN_MODELS)."""
        buildable(profile, request.param, request)
        return request.param

    @pytest.fixture
    def train_dir(self, train_model, tmp_path_factory):
        """The tiny checkpoint of `train_model`."""
        return checkpoint_of(train_model, tmp_path_factory)

    @layer3
    def test_l3_train_step_matches_reference(self, profile, train_model, train_dir):
        """One `train_step` at dp = 1: loss, grad norm and weights of the reference."""
        batch, truth, tolerance = reference_of(train_model, train_dir)
        problems = step_problems([step_here(profile, train_dir, batch)], truth, tolerance,
                                 profile.cls)
        fail_listing(problems, f"{profile.name} {train_model} train_step (dp=1) vs reference")

    @layer3
    def test_l3_train_step_dp2_matches_reference(self, profile, first_model, tmp_path_factory):
        """Two processes at dp = 2: the reference's step, identical replicas, HF names."""
        train_model, train_dir = first_model, checkpoint_of(first_model, tmp_path_factory)
        batch, truth, tolerance = reference_of(train_model, train_dir)
        results = run_two_ranks(profile, train_dir, batch)
        config = hf_config(ENGINE_MODELS[train_model])
        problems = name_problems([s for r in results for s in r.specs], hf_parameters(config),
                                 tied=bool(config.tie_word_embeddings), engine=profile.cls.__name__)
        if not problems:
            problems = step_problems(results, truth, tolerance, profile.cls)
        fail_listing(problems, f"{profile.name} {train_model} train_step (dp=2) vs reference")

    @layer3
    def test_l3_train_shared_prompts_match_unshared(self, profile, train_model, train_dir):
        """Rows that share a prompt give the log-probs of the same samples unshared."""
        engine = train_engine(profile, train_dir, **_one_rank())
        try:
            if not getattr(engine, "shares_prompts", False):
                pytest.skip(f"{profile.name} does not share prompts (CausalLMTrainEngine."
                            "shares_prompts is false for this model)")
            batch = reference_of(train_model, train_dir)[0]
            shared = engine.forward_logprobs(batch).rows()
            engine.shares_prompts = False
            unshared = engine.forward_logprobs(batch).rows()
        finally:
            engine.shutdown()
        config = hf_config(ENGINE_MODELS[train_model])
        tensors = load_checkpoint_tensors(train_dir)
        want, tolerance = derive(lambda dtype, attn: reference_logprobs(
            config, tensors, rows(), TEMPERATURE, dtype=dtype, attn_implementation=attn))
        gap, plain = worst_gap(shared, want), worst_gap(unshared, want)
        method = own_method(profile.cls, ("forward_micro",))
        assert gap <= tolerance.atol, (
            f"rows sharing a prompt score {gap:.2e} off the reference ({tolerance.explain()}), "
            f"the same samples unshared {plain:.2e}: with shares_prompts, {method} must pass "
            "inputs.attention_mask_as(dtype) (the 4-D mask that keeps each answer to its own "
            "tokens) and inputs.position_ids to the model")

    @layer3
    def test_l3_train_checkpoint_round_trip(self, request, profile, first_model,
                                            tmp_path_factory, tmp_path):
        """Save → a fresh engine → load: same version, log-probs, export and next step."""
        needs(request, profile, "checkpoint")
        train_model, train_dir = first_model, checkpoint_of(first_model, tmp_path_factory)
        batch = reference_of(train_model, train_dir)[0]
        first = train_engine(profile, train_dir, **_one_rank())
        fresh = None
        try:
            first.train_step(batch, train_loss())
            first.save_checkpoint(str(tmp_path / "ckpt"))
            fresh = train_engine(profile, train_dir, **_one_rank())
            fresh.load_checkpoint(str(tmp_path / "ckpt"))
            problems = resume_problems(profile, first, fresh, batch, str(tmp_path / "ckpt"),
                                       train_dir)
        finally:
            for engine in (first, fresh):
                if engine is not None:
                    engine.shutdown()
        fail_listing(problems, f"{profile.name} {train_model} checkpoint round trip")


def _one_rank() -> dict:
    from peerflow.conformance.engines import world_group
    from peerflow.distributed.devices import rank_device
    from peerflow.layout import ParallelLayout

    return {"layout": ParallelLayout(), "rank": 0, "group": world_group(),
            "device": str(rank_device())}


def resume_problems(profile, first, fresh, batch, directory: str, model_dir: str) -> list[str]:
    """What a resumed engine does differently from the one that never stopped."""
    cls = profile.cls.__qualname__
    problems = []
    if fresh.version != first.version:
        problems.append(f"version {fresh.version} after load_checkpoint, {first.version} when "
                        f"saved: {cls}.save_checkpoint must store it, load_checkpoint restore it")
    specs, live = exported(first)
    shards = profile.cls.saved_shards(directory, model_path=model_dir, options=first.options)
    saved: dict[str, torch.Tensor] = {}
    if shards:
        sources: dict[int, list] = {}
        for shard in shards:
            sources.setdefault(shard.source, []).append(shard)
        saved = assemble({k: [s.spec for s in v] for k, v in sources.items()},
                         {k: {s.spec.local_name: s.read() for s in v} for k, v in sources.items()})
    full = assemble({0: specs}, {0: live})
    wrong = sorted(n for n in full if n not in saved or not torch.equal(
        saved[n].double(), full[n]))
    if wrong:
        problems.append(f"saved_shards (what peerflow export reads) differs from the live "
                        f"weights in {wrong[:4]}: {cls}.saved_shards must describe exactly "
                        "what save_checkpoint wrote")
    gap = worst_gap(first.forward_logprobs(batch).rows(), fresh.forward_logprobs(batch).rows())
    if gap:
        problems.append(f"log-probs after load_checkpoint differ by {gap:.2e} from the saving "
                        f"engine's: {cls}.load_checkpoint does not restore every weight")
    before, after = first.train_step(batch, train_loss()), fresh.train_step(batch, train_loss())
    for key in ("loss", "grad_norm", "lr"):
        if before.get(key) != after.get(key):
            problems.append(f"the next step's {key} is {after.get(key)!r} resumed, "
                            f"{before.get(key)!r} uninterrupted: {cls}.load_checkpoint must "
                            "restore the optimiser state and the learning-rate schedule")
    step_gap = weight_gap(assemble({0: specs}, {0: exported(first)[1]}),
                          assemble({0: specs}, {0: exported(fresh)[1]}))
    if step_gap:
        problems.append(f"the weights after the next step differ by {step_gap:.2e}: "
                        f"{cls}.load_checkpoint must restore the optimiser's moments")
    return problems
