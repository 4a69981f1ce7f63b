"""Layer 3 for rollout adapters: the real engine, loaded through the adapter.

Read back around the adapter (bit-exact, corrupt-then-restore, copies not references),
then behaviour: non-greedy log-probs at T = 1 and T = 0.7 against a plain HF model after
a sync. A behavioural mismatch is explained by `peerflow.conformance.diagnose`, which
names the block, the parameter and the region.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from peerflow.conformance.base import needs
from peerflow.conformance.checks import compare
from peerflow.conformance.diagnose import diagnose, gap
from peerflow.conformance.engines import as_declared, read_weights, scribble
from peerflow.conformance.harness import run_threaded
from peerflow.conformance.layers import fail_listing
from peerflow.conformance.layers_engine import PROMPTS, EngineLayerBase, layer3, specs_equal
from peerflow.conformance.models import ENGINE_MODELS, hf_config
from peerflow.conformance.oracle import arange_globals, shard_all
from peerflow.conformance.reference import (
    TensorSource,
    load_checkpoint_tensors,
    reference_logprobs,
)
from peerflow.conformance.tolerance import derive
from peerflow.conformance.trainers import trainer_layouts
from peerflow.engines import GenerationRequest, RolloutEngine, SamplingParams
from peerflow.models import hf_parameters
from peerflow.reshard import plan_reshard, sync_weights

#: Temperatures the log-prob contract is checked at (non-greedy).
TEMPERATURES = (1.0, 0.7)


def override_without_super(cls: type, method: str) -> str | None:
    """Names the first override of `method` in `cls`'s MRO that never calls super()."""
    for klass in cls.__mro__:
        if klass is RolloutEngine:
            return None
        function = vars(klass).get(method)
        if function is None:
            continue
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            return None
        if f"super().{method}" not in source:
            return f"{klass.__qualname__}.{method}"
    return None


def check_version(engine: RolloutEngine, version: int) -> None:
    """Fails naming the missing super() call when a sync did not publish `version`."""
    if engine.weight_version == version:
        return
    culprit = override_without_super(type(engine), "finish_weight_update") or \
        override_without_super(type(engine), "begin_weight_update")
    fix = (f"{culprit} overrides it without calling super(); add "
           f"`super().{culprit.rsplit('.', 1)[1]}(…)`") if culprit else \
        "make finish_weight_update() publish the version begin_weight_update(version) announced"
    pytest.fail(f"{type(engine).__name__}.weight_version is {engine.weight_version} after a "
                f"sync to version {version}: RolloutEngine.finish_weight_update publishes the "
                f"version, and {fix}.", pytrace=False)


def sync(engine: RolloutEngine, full: dict[str, torch.Tensor], version: int) -> None:
    """Syncs full HF tensors into the engine (buckets of 64 KiB) and checks the version."""
    sync_weights(TensorSource(full), engine, version=version, bucket_bytes=1 << 16)
    check_version(engine, version)


def sample(engine: RolloutEngine, temperature: float, seed: int = 3):
    """Non-greedy samples of the fixed prompts: `(results, rows)`."""
    requests = [GenerationRequest(request_id=i, prompt_ids=p) for i, p in enumerate(PROMPTS)]
    results = engine.generate(requests, SamplingParams(n=2 if temperature else 1, seed=seed,
                                                       temperature=temperature, max_tokens=8))
    rows = [(PROMPTS[r.request_id], tuple(r.token_ids)) for r in results]
    for r in results:
        assert len(r.logprobs) == len(r.token_ids), (
            f"{type(engine).__name__}.generate returned {len(r.logprobs)} log-probs for "
            f"{len(r.token_ids)} tokens; return one per generated token")
    return results, rows


def _logprobs(results) -> list[torch.Tensor]:
    return [torch.tensor(r.logprobs, dtype=torch.float64) for r in results]


class Layer3RolloutEngine(EngineLayerBase):
    """Layer 3 for rollout adapters: load through the adapter, read back around it."""

    @layer3
    def test_l3_declared_layout_matches_engine(self, profile, engine, engine_model):
        """`weight_targets()` of a real engine equals the declared `shard_layout`."""
        specs_equal(self.declared(profile, engine_model), list(engine.weight_targets()),
                    f"{profile.name} {engine_model} weight_targets")

    def _full(self, engine_model):
        return arange_globals(hf_parameters(hf_config(ENGINE_MODELS[engine_model])))

    def _expect_exact(self, profile, engine, full, before, what):
        specs = list(engine.weight_targets())
        got = as_declared(read_weights(profile, engine), specs)
        untouched = sorted(s.local_name for s in specs if s.local_name in before and
                           s.local_name in got and torch.equal(got[s.local_name],
                                                                before[s.local_name]))
        if untouched:
            fail_listing([f"{profile.cls.__qualname__}.load_weights must copy every (spec, tensor) "
                   f"item of every bucket; {len(untouched)} of {len(specs)} tensors kept their "
                   "old values (a skipped layer or a dropped bucket?)"] +
                         ["not written by the sync (still holding their old values): " +
                   ", ".join(untouched)], what)
        fail_listing(compare(shard_all({0: specs}, full), {0: got}, {0: specs},
                             check_padding=False), what)

    @layer3
    def test_l3_load_is_bit_exact(self, profile, engine, engine_model, request):
        """Unique `arange` weights loaded through the adapter read back bit-exact."""
        needs(request, profile, "in_place_weight_update")
        before = {n: t.clone() for n, t in read_weights(profile, engine).items()}
        full = self._full(engine_model)
        sync(engine, full, 1)
        self._expect_exact(profile, engine, full, before,
                           f"{profile.name} {engine_model} after load")

    @layer3
    def test_l3_corrupt_then_restore(self, profile, engine, engine_model, request):
        """Scribbled engine weights are restored bit-exact by the next sync."""
        needs(request, profile, "in_place_weight_update")
        full = self._full(engine_model)
        sync(engine, full, 1)
        before = {n: t.clone() for n, t in read_weights(profile, engine).items()}
        scribble(profile, engine)
        after = {n: t.clone() for n, t in read_weights(profile, engine).items()}
        assert any(not torch.equal(before[n], after[n]) for n in before), (
            "scribbling changed no weight; conformance_read_weights must return live tensors "
            "or the adapter must define conformance_scribble(engine)")
        sync(engine, full, 2)
        self._expect_exact(profile, engine, full, after,
                           f"{profile.name} {engine_model} after restore")

    @layer3
    def test_l3_sync_from_trainer_layouts(self, profile, engine, engine_model, request):
        """Weights held in every built-in trainer layout load into the engine bit-exact.

        Each registered train engine's layouts (FSDP dp shards, DTensor tp, Megatron
        tp/pp, DeepSpeed ZeRO-3 owners) are the sources, one thread per trainer rank; the
        engine is one more rank, loaded through `load_weights` as in a real sync.
        """
        needs(request, profile, "in_place_weight_update")
        config = hf_config(ENGINE_MODELS[engine_model])
        tested = []
        for version, trainer in enumerate(trainer_layouts(), start=10):
            src = trainer.specs(config)
            if src is None:
                continue
            full = arange_globals(hf_parameters(config), start=version)
            rank = trainer.layout.world_size
            plan = plan_reshard(src, {rank: list(engine.weight_targets())})
            before = {n: t.clone() for n, t in read_weights(profile, engine).items()}
            engine.begin_weight_update(version)
            run_threaded(plan, shard_all(src, full), bucket_bytes=1 << 16,
                         engines={rank: engine})
            engine.finish_weight_update()
            check_version(engine, version)
            self._expect_exact(profile, engine, full, before,
                               f"{profile.name} {engine_model} synced from trainer {trainer.id}")
            tested.append(trainer.id)
        if not tested:
            pytest.skip(f"no registered trainer layout supports {engine_model}")
        request.node.user_properties.append(("trainer_layouts", ",".join(tested)))

    @layer3
    def test_l3_load_copies_instead_of_keeping_references(self, profile, engine, engine_model,
                                                          model_dir, request):
        """After `load_weights`, reusing the caller's tensors changes nothing in the engine."""
        needs(request, profile, "in_place_weight_update")
        full = load_checkpoint_tensors(model_dir)
        full = {n: full[n] for n in hf_parameters(hf_config(ENGINE_MODELS[engine_model]))}
        specs = list(engine.weight_targets())
        given = shard_all({0: specs}, full)[0]
        engine.begin_weight_update(3)
        engine.load_weights([(s, given[s.local_name]) for s in specs])
        engine.finish_weight_update()
        check_version(engine, 3)
        live = read_weights(profile, engine) if profile.hook("conformance_read_weights") \
            else {}
        shared = sorted(n for n, t in live.items() if n in given and
                        t.untyped_storage().data_ptr() == given[n].untyped_storage().data_ptr())
        results, _ = sample(engine, 0.0)
        for tensor in given.values():
            tensor.fill_(0.5)  # the sync reuses its buffers for the next bucket
        again, _ = sample(engine, 0.0)
        problems = [f"{n}: the engine's tensor is the caller's buffer" for n in shared]
        if gap(_logprobs(results), _logprobs(again)) > 1e-6 or \
                [r.token_ids for r in results] != [r.token_ids for r in again]:
            problems.append("the engine's outputs changed when the caller overwrote the "
                            "tensors it had passed to load_weights")
        if problems:
            problems.append(f"{profile.cls.__qualname__}.load_weights keeps the tensors it is "
                            "given instead of copying them; copy into the engine's own storage "
                            "(param.copy_(tensor)), never `param.data = tensor` or a new "
                            "Parameter around it")
        fail_listing(problems, f"{profile.name} {engine_model} load_weights")

    @layer3
    @pytest.mark.parametrize("temperature", TEMPERATURES, ids=lambda t: f"T{t}")
    def test_l3_logprobs_match_reference_after_sync(self, profile, engine, engine_model,
                                                    model_dir, logprob_atol, temperature,
                                                    request):
        """After a sync, sampled-token log-probs are `log_softmax(logits / T)` of HF's model.

        Non-greedy, at T = 1 and T = 0.7. A mismatch is explained: untempered log-probs
        name `generate`; a layout the engine does not follow names the block, parameter
        and region (see `peerflow.conformance.diagnose`).
        """
        needs(request, profile, "in_place_weight_update")
        needs(request, profile, "logprobs")
        config = hf_config(ENGINE_MODELS[engine_model])
        generator = torch.Generator().manual_seed(1)
        new = {n: t + 0.05 * torch.randn(t.shape, generator=generator)
               for n, t in load_checkpoint_tensors(model_dir).items()
               if n in hf_parameters(config)}
        sync(engine, new, 5)
        results, rows = sample(engine, temperature)
        stale = sorted({r.version_segments for r in results} - {((0, 5),)})
        assert not stale, (
            f"{profile.cls.__qualname__}.generate reports version_segments {stale[0]} after a "
            "sync to version 5; report ((0, self.weight_version),), the version the tokens "
            "came from")
        got = _logprobs(results)
        want, tolerance = derive(lambda dtype, attn: reference_logprobs(
            config, new, rows, temperature, dtype=dtype, attn_implementation=attn),
            logprob_atol)
        worst = gap(got, want)
        request.node.user_properties.append(("logprob_gap", f"{worst:.2e}"))
        if worst <= tolerance.atol:
            return
        atol = tolerance.atol
        what = (f"{profile.name} {engine_model}: log-probs at temperature {temperature} differ "
                f"from log_softmax(logits / T) of the reference model by {worst:.2e} > "
                f"{tolerance.explain()}, after a sync")
        if temperature != 1.0 and gap(got, reference_logprobs(
                config, new, rows, dtype=torch.float64)) <= atol:
            pytest.fail(f"{what}; they equal the untempered log_softmax(logits). "
                        f"{profile.cls.__qualname__}.generate must return log-probs of the "
                        "sampling distribution, log_softmax(logits / T) before top-k/top-p (vLLM: "
                        "logprobs_mode='processed_logprobs').", pytrace=False)
        specs = list(engine.weight_targets())
        version = iter(range(100, 1000))

        def probe(weights):
            sync(engine, dict(weights), next(version))
            results, rows = sample(engine, 1.0)
            return rows, _logprobs(results)

        pytest.fail(f"{what}.\n  {diagnose(probe, config, new, specs, atol=atol)}",
                    pytrace=False)
