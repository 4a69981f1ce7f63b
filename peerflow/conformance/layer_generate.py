"""Layer 3, generate contract: what `RolloutEngine.generate` promises beyond log-probs.

What engines get wrong, each its own test (group `generate`: a failure here skips only
the rest of this group, never the core layer-3 tests):

* results grouped by request, in request order, `index` 0 … n-1 (`request_id` echoed);
* `finish_reason`: `length` exactly when `max_tokens` ran out, `stop` when an EOS id, a
  `stop_token_ids` entry or a stop string ended the sample (overlong filtering and
  length penalties train on it);
* a sample ends at a `stop_token_ids` entry and at an EOS id, keeping it;
* stop strings, when `Capabilities.stop_strings` is declared: the sample ends at the
  first one, which is removed from `token_ids`;
* greedy decoding (T = 0) is deterministic and picks the reference model's argmax;
* a seed reproduces the samples, another seed changes them;
* `top_k`/`top_p` are honoured with untruncated log-probs, or refused with `ConfigError`;
* `generate` leaves torch's global RNG state alone (a colocated trainer shares it).

The layer runs on one model (the first of the adapter's families), on the checkpoint's
own weights except for the EOS test, which syncs weights that make EOS the greedy token.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from peerflow.conformance.base import needs
from peerflow.conformance.layers import fail_listing
from peerflow.conformance.layers_engine import PROMPTS, EngineLayerBase, layer3
from peerflow.conformance.models import ENGINE_MODELS, family, hf_config
from peerflow.conformance.reference import load_checkpoint_tensors
from peerflow.engines import GenerationRequest, SamplingParams
from peerflow.errors import ConfigError
from peerflow.models import hf_parameters

generate_group = pytest.mark.peerflow_group("generate")

#: Request ids out of order and not 0..n-1, so echoing positions instead of ids shows.
REQUEST_IDS = (7, 3, 11)


def requests_of(prompts=PROMPTS, ids=REQUEST_IDS) -> list[GenerationRequest]:
    """The layer's requests: the fixed prompts under out-of-order request ids."""
    return [GenerationRequest(request_id=i, prompt_ids=p) for i, p in zip(ids, prompts)]


def eos_ids(model_dir: str) -> set[int]:
    """Every EOS id of a checkpoint: generation config, model config and tokenizer."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    found: set[int] = set()
    sources = [AutoConfig.from_pretrained(model_dir)]
    for load in (GenerationConfig.from_pretrained, AutoTokenizer.from_pretrained):
        try:
            sources.append(load(model_dir))
        except (OSError, ValueError):
            continue
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        found.update(value if isinstance(value, (list, tuple)) else
                     [] if value is None else [value])
    return {int(v) for v in found}


def next_token_logits(model_dir: str, rows, tensors: dict | None = None) -> list[torch.Tensor]:
    """float64 logits `[len(response), vocab]` predicting each response token (plain HF)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    if tensors is not None:
        model.load_state_dict(tensors, strict=False)
    out = []
    with torch.no_grad():
        for prompt, response in rows:
            ids = torch.tensor([list(prompt) + list(response)])
            logits = model(input_ids=ids).logits[0].to(torch.float64)
            out.append(logits[len(prompt) - 1:len(prompt) - 1 + len(response)])
    return out


def _who(engine: Any) -> str:
    return f"{type(engine).__qualname__}.generate"


def _tokens(results) -> list[tuple[int, ...]]:
    return [tuple(r.token_ids) for r in results]


class LayerGenerate(EngineLayerBase):
    """Layer 3, generate contract (group `generate`)."""

    @pytest.fixture
    def generate_engine(self, profile, engine_model, request):
        """The engine under test on the layer's one model (other models skip)."""
        families = profile.families()
        model = next((m for m in ENGINE_MODELS if families is None or
                      family(ENGINE_MODELS[m]) in families), None)
        if engine_model != model:
            pytest.skip(f"the generate contract runs on one model ({model})")
        return request.getfixturevalue("engine")

    def _greedy(self, engine, max_tokens=8, **extra):
        return engine.generate(requests_of(), SamplingParams(
            n=1, temperature=0.0, max_tokens=max_tokens, **extra))

    @layer3
    @generate_group
    def test_l3_generate_groups_results_by_request(self, generate_engine):
        """`len(requests) * n` results, grouped by request in request order, index 0 … n-1."""
        n, max_tokens = 3, 4
        results = generate_engine.generate(requests_of(), SamplingParams(
            n=n, temperature=1.0, seed=5, max_tokens=max_tokens))
        want = [(rid, j) for rid in REQUEST_IDS for j in range(n)]
        got = [(r.request_id, r.index) for r in results]
        problems = []
        if got != want:
            problems.append(f"(request_id, index) of the results are {got}; the contract is "
                            f"{want}: len(requests) * n results, grouped by request in request "
                            "order, index 0 … n-1 inside a group, request_id echoed")
        for r in results:
            if not 1 <= len(r.token_ids) <= max_tokens or len(r.logprobs) != len(r.token_ids):
                problems.append(f"request {r.request_id} sample {r.index}: "
                                f"{len(r.token_ids)} tokens, {len(r.logprobs)} log-probs "
                                f"(max_tokens={max_tokens}; one log-prob per token)")
        fail_listing(problems, f"{_who(generate_engine)} result order")

    @layer3
    @generate_group
    def test_l3_generate_finish_reason(self, generate_engine, model_dir):
        """`length` exactly when `max_tokens` ran out; `stop` when an EOS id ended it."""
        eos = eos_ids(model_dir)
        max_tokens = 6
        results = self._greedy(generate_engine, max_tokens) + generate_engine.generate(
            requests_of(), SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=max_tokens))
        problems = []
        for r in results:
            where = f"request {r.request_id} sample {r.index} {list(r.token_ids)}"
            ended_on_eos = bool(r.token_ids) and r.token_ids[-1] in eos
            early = [i for i, t in enumerate(r.token_ids[:-1]) if t in eos]
            if early:
                problems.append(f"{where}: EOS id {r.token_ids[early[0]]} at position "
                                f"{early[0]} did not end the sample")
            elif r.finish_reason not in ("stop", "length"):
                problems.append(f"{where}: finish_reason {r.finish_reason!r}; use 'stop' or "
                                "'length'")
            elif ended_on_eos and r.finish_reason != "stop":
                problems.append(f"{where}: ended on EOS but finish_reason is "
                                f"{r.finish_reason!r}; report 'stop'")
            elif not ended_on_eos and len(r.token_ids) == max_tokens and \
                    r.finish_reason != "length":
                problems.append(f"{where}: hit max_tokens={max_tokens} without EOS but "
                                f"finish_reason is {r.finish_reason!r}; report 'length' "
                                "(overlong filtering and length penalties train on it)")
            elif not ended_on_eos and len(r.token_ids) < max_tokens:
                problems.append(f"{where}: ended after {len(r.token_ids)} < max_tokens="
                                f"{max_tokens} tokens with no EOS or stop token "
                                f"(finish_reason {r.finish_reason!r})")
        fail_listing(problems, f"{_who(generate_engine)} finish_reason (EOS ids {sorted(eos)})")

    @layer3
    @generate_group
    def test_l3_generate_ends_at_stop_token_ids(self, generate_engine):
        """A `stop_token_ids` entry ends the sample (kept in `token_ids`, finish `stop`)."""
        greedy = _tokens(self._greedy(generate_engine))
        first = greedy[0]
        k = next((i for i in range(1, len(first)) if first[i] not in first[:i]), 0)
        stop = first[k]
        got = self._greedy(generate_engine, stop_token_ids=(stop,))
        want = first[:k + 1]
        problems = []
        if tuple(got[0].token_ids) != want or got[0].finish_reason != "stop":
            problems.append(
                f"greedy answer is {list(first)}; with stop_token_ids=({stop},) it must end "
                f"at that token, keeping it: {list(want)} with finish_reason 'stop', but "
                f"{_who(generate_engine)} returned {list(got[0].token_ids)} with "
                f"{got[0].finish_reason!r}. End a sample at any SamplingParams.stop_token_ids "
                "entry, as at EOS")
        fail_listing(problems, f"{_who(generate_engine)} stop_token_ids")

    @layer3
    @generate_group
    def test_l3_generate_ends_at_eos(self, profile, generate_engine, engine_model, model_dir,
                                     request):
        """With weights making EOS the greedy first token, the sample is exactly `[EOS]`."""
        needs(request, profile, "in_place_weight_update")
        from peerflow.conformance.layer3_rollout import sync

        eos = min(eos_ids(model_dir))
        first = _tokens(self._greedy(generate_engine))[0][0]
        config = hf_config(ENGINE_MODELS[engine_model])
        weights = {n: t.clone() for n, t in load_checkpoint_tensors(model_dir).items()
                   if n in hf_parameters(config)}
        head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        weights[head][eos] = 4.0 * weights[head][first]
        tensors = dict(weights)
        if head != "lm_head.weight":
            tensors["lm_head.weight"] = weights[head]
        (logits,) = next_token_logits(model_dir, [(PROMPTS[0], (eos,))], tensors)
        if int(logits[0].argmax()) != eos:
            pytest.skip("could not make EOS the reference's greedy first token")
        sync(generate_engine, weights, 1)
        got = self._greedy(generate_engine)[0]
        if tuple(got.token_ids) != (eos,) or got.finish_reason != "stop":
            pytest.fail(
                f"after a sync making EOS id {eos} the greedy first token, "
                f"{_who(generate_engine)} returned {list(got.token_ids)} with finish_reason "
                f"{got.finish_reason!r}; want [{eos}] and 'stop'. A sample ends at an EOS id "
                "(every eos_token_id of generation_config.json, config.json and the "
                "tokenizer), EOS kept in token_ids", pytrace=False)

    @layer3
    @generate_group
    def test_l3_generate_honours_stop_strings(self, profile, generate_engine, model_dir,
                                              request):
        """With `Capabilities.stop_strings`, a sample ends at the first stop string, cut off."""
        needs(request, profile, "stop_strings")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        first = _tokens(self._greedy(generate_engine, max_tokens=12))[0]
        special = set(tokenizer.all_special_ids)
        text = [tokenizer.decode([t]) for t in first]
        k = next((i for i in range(1, len(first) - 1)
                  if not special & set(first[:i + 2]) and all(len(c) == 1 for c in text[:i + 2])
                  and "".join(text[i:i + 2]) not in "".join(text[:i + 1])), None)
        if k is None:
            pytest.skip(f"the greedy answer {list(first)} has no usable stop string")
        stop = "".join(text[k:k + 2])
        got = self._greedy(generate_engine, max_tokens=12, stop=(stop,))[0]
        if tuple(got.token_ids) != first[:k] or got.finish_reason != "stop":
            pytest.fail(
                f"greedy answer {''.join(text)!r}; with stop=({stop!r},) "
                f"{_who(generate_engine)} returned "
                f"{tokenizer.decode(list(got.token_ids))!r} with finish_reason "
                f"{got.finish_reason!r}, want {''.join(text[:k])!r} and 'stop'. It declares "
                "Capabilities.stop_strings: end a sample at the first stop string and remove "
                "it from token_ids (vLLM's default), or do not declare the capability",
                pytrace=False)

    @layer3
    @generate_group
    def test_l3_generate_greedy_is_deterministic(self, generate_engine, model_dir):
        """Temperature 0 repeats itself across calls and picks the reference's argmax."""
        once = _tokens(self._greedy(generate_engine))
        again = _tokens(self._greedy(generate_engine))
        problems = []
        if once != again:
            problems.append(f"two greedy calls returned different tokens: {once} and {again}")
        rows = list(zip(PROMPTS, once))
        for (prompt, response), logits in zip(rows, next_token_logits(model_dir, rows)):
            logp = torch.log_softmax(logits, -1)
            for i, token in enumerate(response):
                best = int(logp[i].argmax())
                if float(logp[i, best] - logp[i, token]) > 1e-3:
                    problems.append(
                        f"prompt {list(prompt)} position {i}: greedy token {token} has "
                        f"reference log-prob {float(logp[i, token]):.4f}, the argmax {best} "
                        f"{float(logp[i, best]):.4f}")
                    break
        fail_listing(problems, f"{_who(generate_engine)} with temperature 0 (greedy)")

    @layer3
    @generate_group
    def test_l3_generate_seed_reproduces(self, generate_engine):
        """The same seed gives the same samples; another seed other samples."""
        def run(seed):
            return _tokens(generate_engine.generate(requests_of(), SamplingParams(
                n=4, temperature=1.5, seed=seed, max_tokens=8)))

        first, again, other = run(11), run(11), run(12)
        problems = []
        if first != again:
            problems.append("two calls with SamplingParams(seed=11) returned different "
                            "samples; with a seed the same requests must give the same answers "
                            "(seed a generator of the engine's own from it)")
        if first == other:
            problems.append("seed=11 and seed=12 returned the same samples; the seed is "
                            "ignored")
        fail_listing(problems, f"{_who(generate_engine)} seeded sampling")

    @layer3
    @generate_group
    def test_l3_generate_leaves_torch_rng_alone(self, generate_engine):
        """`generate` neither draws from nor reseeds torch's global RNG (trainers share it)."""
        saved = torch.get_rng_state()
        torch.manual_seed(20261128)
        before = torch.get_rng_state()
        devices = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        try:
            for seed in (None, 3):
                generate_engine.generate(requests_of(), SamplingParams(
                    n=2, temperature=1.0, seed=seed, max_tokens=4))
            changed = not torch.equal(torch.get_rng_state(), before)
            cuda = torch.cuda.is_available() and any(
                not torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), devices))
        finally:
            torch.set_rng_state(saved)
        if changed or cuda:
            pytest.fail(
                f"{_who(generate_engine)} changed torch's global "
                f"{'CUDA ' if cuda and not changed else ''}RNG state: it reseeds it "
                "(torch.manual_seed) or samples from the default generator. A colocated "
                "trainer draws from the same stream (dropout, data order), so its run then "
                "depends on the rollout. Sample with a torch.Generator of the engine's own; "
                "a library that samples from the global generator runs on an RNG state of "
                "the engine's own, swapped in around the call and saved back after it "
                "(torch.random.fork_rng + torch.set_rng_state, as the vllm adapter's "
                "EngineRandomState does; fork_rng alone would repeat the same draws every "
                "call)", pytrace=False)

    @layer3
    @generate_group
    @pytest.mark.parametrize("truncation", ({"top_k": 3}, {"top_p": 0.5}),
                             ids=("top_k", "top_p"))
    def test_l3_generate_truncation_honoured_or_refused(self, generate_engine, model_dir,
                                                        truncation):
        """`top_k`/`top_p`: tokens inside the cut and untruncated log-probs, or `ConfigError`."""
        params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=6, **truncation)
        try:
            results = generate_engine.generate(requests_of(), params)
        except ConfigError:
            return  # refused, as the contract allows
        except Exception as exc:  # noqa: BLE001 — the failure names what was raised
            pytest.fail(f"{_who(generate_engine)} raised {type(exc).__name__} for "
                        f"{truncation}: {exc}. Refuse a setting it cannot do with "
                        "peerflow.errors.ConfigError, naming the setting", pytrace=False)
        prompts = dict(zip(REQUEST_IDS, PROMPTS))
        rows = [(prompts[r.request_id], tuple(r.token_ids)) for r in results]
        problems = []
        for r, (_, response), logits in zip(results, rows, next_token_logits(model_dir, rows)):
            logp = torch.log_softmax(logits, -1)
            for i, token in enumerate(response):
                above = logp[i] > logp[i, token] + 1e-6
                if "top_k" in truncation and int(above.sum()) >= truncation["top_k"]:
                    problems.append(f"token {token} at position {i} is outside the top "
                                    f"{truncation['top_k']} ({int(above.sum())} more likely)")
                if "top_p" in truncation and float(logp[i][above].exp().sum()) >= \
                        truncation["top_p"] + 1e-4:
                    problems.append(f"token {token} at position {i} is outside the top-p "
                                    f"{truncation['top_p']} nucleus")
                if r.logprobs and abs(r.logprobs[i] - float(logp[i, token])) > 1e-3:
                    problems.append(f"token {token} at position {i}: log-prob "
                                    f"{r.logprobs[i]:.4f}, log_softmax(logits / T) is "
                                    f"{float(logp[i, token]):.4f} — renormalised after the "
                                    "cut? Report the untruncated value or refuse with "
                                    "ConfigError")
        fail_listing(problems[:6], f"{_who(generate_engine)} with {truncation} (honour it or raise "
                     "ConfigError)")


__all__ = ["LayerGenerate", "eos_ids", "next_token_logits", "requests_of"]
