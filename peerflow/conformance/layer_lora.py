"""The LoRA layer (layer 3, real engines): for adapters that declare `Capabilities.lora`.

Rollout adapters: peft-format adapter tensors (`A` and `B` both non-zero, unique values,
`alpha / rank = 3`) synced through the adapter arrive bit-exact (read around the adapter
by its `conformance_read_adapters(engine)` hook), and the engine's non-greedy log-probs
at T = 0.7 then equal `log_softmax(logits / T)` of the **oracle**: transformers + peft
directly (`get_peft_model`, `set_peft_model_state_dict`), bypassing the code under test.
A mismatch is bisected to one adapted module by syncing its adapter alone (every other
`B` zero), and names its `lora_A`/`lora_B` tensors — with a hint when the engine matches
the oracle at another scaling (`alpha / rank` applied wrong).

Train adapters: `weight_sources()` lists exactly peft's adapter tensors, only they are
trainable, and after a step `forward_logprobs` equals the oracle with the adapters read
out of the engine (`materialize`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.conformance.base import needs
from peerflow.conformance.diagnose import gap
from peerflow.conformance.engines import build_engine, read_weights
from peerflow.conformance.layers import fail_listing
from peerflow.conformance.layers_engine import PROMPTS, EngineLayerBase, layer3
from peerflow.conformance.reference import TensorSource, score_rows
from peerflow.conformance.tolerance import derive
from peerflow.engines import GenerationRequest, SamplingParams
from peerflow.engines.lora import LoraConfig
from peerflow.reshard import sync_weights

#: The adapters the layer syncs: every linear layer, scaling alpha / rank = 3.
LORA = LoraConfig(rank=4, alpha=12.0, target_modules="all-linear")
TEMPERATURE = 0.7
#: The model the layer runs on (one: every test builds an engine; untied head, q/k/v
#: biases). The unit tests of the built-in adapters cover Llama and Qwen2 with LoRA.
LORA_MODELS = ("qwen2-untied",)
#: The LoRA tests are their own group of layer 3: a LoRA failure skips only LoRA tests.
lora_group = pytest.mark.peerflow_group("lora")


def adapter_tensors(model_dir: str, lora: LoraConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unique non-zero values for every adapter tensor of the model, peft's file names."""
    from peerflow.training.lora import adapter_layout

    shapes, _ = adapter_layout(model_dir, lora)
    generator = torch.Generator().manual_seed(seed)
    return {name: 0.3 * torch.randn(shape, generator=generator)
            for name, shape in shapes.items()}


def oracle_logprobs(model_dir: str, lora: LoraConfig, adapters: Mapping[str, torch.Tensor],
                    rows: Sequence[tuple[Sequence[int], Sequence[int]]],
                    temperature: float, dtype: torch.dtype = torch.float32,
                    attn_implementation: str = "sdpa") -> list[torch.Tensor]:
    """`log_softmax(logits / T)` of each response token under transformers + peft.

    `dtype` and `attn_implementation` pick the numerical path (see
    `peerflow.conformance.tolerance`).
    """
    from peft import set_peft_model_state_dict

    model = _oracle_model(model_dir, lora, dtype, attn_implementation)
    result = set_peft_model_state_dict(model, dict(adapters))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise KeyError(f"peft does not know adapter tensors {unexpected[:3]}")
    return score_rows(model, rows, temperature)


def read_adapters(profile: Any, engine: Any) -> dict[str, torch.Tensor]:
    """The engine's adapter tensors, read around the adapter, under peft's file names.

    The adapter's `conformance_read_adapters(engine)` hook, else the adapter tensors of
    `conformance_read_weights(engine)` (a peft model's live names, renamed).
    """
    from peerflow.training.lora import adapter_name, is_adapter

    hook = profile.hook("conformance_read_adapters")
    if hook is not None:
        return dict(hook(engine))
    return {adapter_name(n): t for n, t in read_weights(profile, engine).items()
            if is_adapter(n)}


@functools.lru_cache(maxsize=8)
def _oracle_model(model_dir: str, lora: LoraConfig, dtype: torch.dtype = torch.float32,
                  attn_implementation: str = "sdpa") -> Any:
    """The oracle model: the checkpoint under peft (built once; each use sets every adapter)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                attn_implementation=attn_implementation)
    return get_peft_model(base.to(dtype), lora.to_peft()).to(dtype).eval()


def _sample(engine: Any, seed: int = 3) -> tuple[list[torch.Tensor], list[tuple]]:
    requests = [GenerationRequest(request_id=i, prompt_ids=p) for i, p in enumerate(PROMPTS)]
    results = engine.generate(requests, SamplingParams(n=2, seed=seed, max_tokens=8,
                                                       temperature=TEMPERATURE))
    rows = [(PROMPTS[r.request_id], tuple(r.token_ids)) for r in results]
    return [torch.tensor(r.logprobs, dtype=torch.float64) for r in results], rows


def _modules(adapters: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted({name.rsplit(".lora_", 1)[0] for name in adapters})


class LayerLora(EngineLayerBase):
    """LoRA: adapter-only syncs (rollout) and adapter-only training (train)."""

    @pytest.fixture
    def lora_engine(self, profile, engine_model, model_dir, request):
        """A one-rank engine of the adapter built with `trainer.lora` (`LORA`)."""
        needs(request, profile, "lora")
        if engine_model not in LORA_MODELS:
            pytest.skip(f"the LoRA layer runs on {LORA_MODELS}")
        missing = profile.cls.missing_requirements()
        if missing:
            pytest.skip(f"{profile.name} needs {missing}: {profile.cls.install_hint}")
        pytest.importorskip("peft")
        engine = build_engine(profile, model_dir, lora=LORA)
        yield engine
        engine.shutdown()

    def _rollout_only(self, profile) -> None:
        if profile.kind != "rollout":
            pytest.skip("a rollout-adapter check")

    @layer3
    @lora_group
    def test_l3_lora_adapters_arrive_bit_exact(self, profile, lora_engine, model_dir):
        """Adapter tensors synced through the adapter read back bit-exact, and only they."""
        self._rollout_only(profile)
        adapters = adapter_tensors(model_dir, LORA)
        targets = {s.local_name for s in lora_engine.weight_targets()}
        problems = [f"{n}: an adapter tensor weight_targets() does not list"
                    for n in sorted(adapters.keys() - targets)]
        problems += [f"{n}: listed by weight_targets() but not an adapter tensor (with "
                     "trainer.lora only the adapters move)"
                     for n in sorted(targets - adapters.keys())]
        fail_listing(problems, f"{profile.name} LoRA weight_targets")
        sync_weights(TensorSource(adapters), lora_engine, version=1, bucket_bytes=1 << 14)
        got = read_adapters(profile, lora_engine)
        wrong = [f"{n}: not where the engine applies it (read back "
                 f"{'nothing' if n not in got else 'other values'}); check which module and "
                 "which of A ([rank, in]) and B ([out, rank]) it is loaded into"
                 for n in sorted(adapters) if n not in got or not torch.equal(got[n], adapters[n])]
        fail_listing(wrong, f"{profile.name} LoRA adapters after a sync")

    @layer3
    @lora_group
    def test_l3_lora_logprobs_match_adapted_model(self, profile, lora_engine, model_dir,
                                                  logprob_atol, request):
        """After an adapter sync, log-probs at T = 0.7 are the adapted model's (the oracle)."""
        self._rollout_only(profile)
        needs(request, profile, "logprobs")
        adapters = adapter_tensors(model_dir, LORA)
        sync_weights(TensorSource(adapters), lora_engine, version=1, bucket_bytes=1 << 14)
        got, rows = _sample(lora_engine)
        want, tolerance = derive(lambda dtype, attn: oracle_logprobs(
            model_dir, LORA, adapters, rows, TEMPERATURE, dtype, attn), logprob_atol)
        worst = gap(got, want)
        request.node.user_properties.append(("logprob_gap", f"{worst:.2e}"))
        if worst <= tolerance.atol:
            return
        what = (f"{profile.name}: log-probs at T={TEMPERATURE} differ from the adapted model "
                f"(transformers + peft) by {worst:.2e} > {tolerance.explain()}, after an "
                "adapter sync")
        pytest.fail(f"{what}; {self._bisect(lora_engine, model_dir, adapters, tolerance.atol)}",
                    pytrace=False)

    def _bisect(self, engine: Any, model_dir: str, adapters: dict[str, torch.Tensor],
                atol: float) -> str:
        """Names the first module whose adapter alone already gives other log-probs."""
        for version, module in enumerate(_modules(adapters), start=10):
            alone = {n: (t if n.startswith(module + ".") or ".lora_A." in n
                         else torch.zeros_like(t)) for n, t in adapters.items()}
            sync_weights(TensorSource(alone), engine, version=version, bucket_bytes=1 << 14)
            got, rows = _sample(engine)
            if gap(got, oracle_logprobs(model_dir, LORA, alone, rows, TEMPERATURE)) <= atol:
                continue
            tensors = f"{module}.lora_A.weight / {module}.lora_B.weight"
            for alpha in (LORA.rank, LORA.alpha * LORA.alpha / LORA.rank):
                other = LoraConfig(rank=LORA.rank, alpha=alpha, target_modules="all-linear")
                if gap(got, oracle_logprobs(model_dir, other, alone, rows, TEMPERATURE)) <= atol:
                    return (f"with only {tensors} synced the engine applies scaling "
                            f"{alpha / LORA.rank:g} instead of alpha / rank = {LORA.scaling:g}")
            return (f"with only {tensors} synced the log-probs already differ: check that "
                    f"this adapter is applied to {module} (not another module), as "
                    f"(alpha / rank) * B @ A with A [rank, in] and B [out, rank] (not swapped)")
        return "no single module's adapter differs; check how adapters combine"

    @layer3
    @lora_group
    def test_l3_lora_trains_adapters_only(self, profile, lora_engine, model_dir, logprob_atol):
        """A train engine exports and trains peft's adapters only, and scores with them."""
        if profile.kind != "train":
            pytest.skip("a train-adapter check")
        from peerflow.training.lora import adapter_layout

        shapes, _ = adapter_layout(model_dir, LORA)
        sources = {s.local_name: s.pieces[0].global_shape for s in lora_engine.weight_sources()}
        fail_listing(sorted(f"{n}: {sources.get(n)} in weight_sources(), peft says {shapes.get(n)}"
                     for n in shapes.keys() | sources.keys() if sources.get(n) != shapes.get(n)),
                     f"{profile.name} LoRA weight_sources")
        rows = [(p, tuple(reversed(p))) for p in PROMPTS]
        ragged = {name: RaggedField.from_tensors([torch.tensor(row[i]) for row in rows])
                  for i, name in enumerate(("prompt_ids", "response_ids"))}
        batch = Batch(sample_id=torch.arange(len(rows)), group_id=torch.arange(len(rows)),
                      weight_version=torch.zeros(len(rows), dtype=torch.int64), fields=ragged)
        lora_engine.train_step(batch, _nll)
        specs = list(lora_engine.weight_sources())
        with lora_engine.materialize(specs) as tensors:
            trained = {s.local_name: t.detach().clone() for s, t in zip(specs, tensors)}
        assert any(".lora_B." in n and t.abs().max() > 0 for n, t in trained.items()), \
            f"{profile.name}.train_step left every lora_B at zero: the adapters did not train"
        got = lora_engine.forward_logprobs(batch).rows()
        want, tolerance = derive(lambda dtype, attn: oracle_logprobs(
            model_dir, LORA, trained, rows, lora_engine.context.temperature, dtype, attn),
            logprob_atol)
        worst = gap([g.double() for g in got], want)
        assert worst <= tolerance.atol, (
            f"{profile.name}.forward_logprobs differs from the adapted model (transformers + "
            f"peft with the engine's own adapters) by {worst:.2e} > {tolerance.explain()}")


def _nll(logprobs: RaggedField, batch: Batch, *, global_tokens: int, global_samples: int):
    return -logprobs.values.sum() / global_tokens, {}
