"""Naming a train engine's mistake from what it got wrong, in the author's terms.

Each function turns a measured difference into the likely cause and the fix, naming the
author's own method where the mistake is (not the toolkit's):

* `name_problems` — exported names that are not the model's HF names: a wrapper's
  prefix (`module.` of DistributedDataParallel), a tied head exported twice, an untied
  head left out;
* `grad_norm_hint` — a gradient norm a whole multiple off: gradients averaged over
  dp-ranks where the contract sums them, or reduced twice;
* `temperature_hint` — log-probs of the untempered or twice-tempered distribution.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from peerflow.shard import ShardSpec

#: Where a subclass of the toolkit puts each kind of mistake, most likely first.
_FORWARD_METHODS = ("forward_logprobs", "score", "forward_micro")


def own_method(cls: type, candidates: Sequence[str]) -> str:
    """`Class.method` of the first candidate `cls` defines itself (not peerflow's base)."""
    for klass in inspect.getmro(cls):
        if klass.__module__.startswith("peerflow.training") or \
                klass.__module__.startswith("peerflow.engines"):
            break
        for name in candidates:
            if name in vars(klass):
                return f"{klass.__qualname__}.{name}"
    return f"{cls.__qualname__}.{candidates[-1]}"


def _prefix(name: str, canonical: Iterable[str]) -> str | None:
    """The prefix that makes `name` a canonical name, if one does."""
    matches = [name[: -len(c)] for c in canonical if name.endswith("." + c)]
    return min(matches, key=len) if matches else None


def name_problems(specs: Iterable[ShardSpec], canonical: Mapping[str, object], *,
                  tied: bool, engine: str) -> list[str]:
    """Problems with the HF names the specs' pieces claim, each with its likely cause.

    Args:
        specs: Every rank's `weight_sources()` together.
        canonical: The model's HF tensors (`peerflow.models.hf_parameters`).
        tied: `tie_word_embeddings` of the model.
        engine: The engine class's name, for the messages.
    """
    names = {piece.name for spec in specs for piece in spec.pieces}
    unknown = sorted(names - canonical.keys())
    missing = sorted(canonical.keys() - names)
    problems = []
    prefixes = Counter(p for p in (_prefix(n, canonical) for n in unknown) if p is not None)
    if prefixes:
        prefix, count = prefixes.most_common(1)[0]
        problems.append(
            f"{count} exported names carry the prefix {prefix!r} (e.g. {unknown[0]!r}): the "
            f"names of a wrapper (DistributedDataParallel's or FSDP's `module.`), not the "
            f"model's; {engine}.weight_sources must name the unwrapped model's parameters "
            f"(e.g. {unknown[0].removeprefix(prefix)!r})")
        unknown = [n for n in unknown if _prefix(n, canonical) != prefix]
        missing = [n for n in missing if prefix + n not in names]
    if tied and "lm_head.weight" in unknown:
        problems.append(
            f"lm_head.weight is exported, but the model ties it to model.embed_tokens.weight "
            f"(tie_word_embeddings): {engine}.weight_sources must export the embedding only")
        unknown.remove("lm_head.weight")
    if not tied and "lm_head.weight" in missing:
        problems.append(
            f"lm_head.weight is not exported, but the model's head is untied "
            f"(tie_word_embeddings false): {engine}.weight_sources must export it too")
        missing.remove("lm_head.weight")
    problems += [f"{n}: exported, but not a tensor of this model (the engine's names: "
                 f"{sorted(names)[:4]}…)" for n in unknown]
    problems += [f"{n}: a tensor of the model no rank exports" for n in missing]
    return problems


def grad_norm_hint(got: float, want: float, *, dp: int, cls: type) -> str:
    """Why a gradient norm is off, when it is off by a whole factor; else ``""``."""
    if not want:
        return ""
    ratio = got / want
    backward = own_method(cls, ("backward_micro", "train_step"))
    if dp > 1 and abs(ratio * dp - 1) < 0.05:
        return (f" The norm is 1/{dp} of the reference's at dp={dp}: gradients are averaged "
                f"over the dp-ranks (DistributedDataParallel and all-reduce-mean do that), but "
                f"losses are normalised by the global token count, so gradients must be "
                f"summed: {backward} must multiply the loss by the dp size ({dp}) before "
                f"backward.")
    if abs(ratio - dp) < 0.05 * dp and dp > 1 or abs(ratio - 2) < 0.1:
        return (f" The norm is {ratio:.2f}x the reference's: gradients are reduced twice "
                f"(the framework's reduction and the author's) or the loss is scaled twice; "
                f"{backward} must scale once.")
    return ""


def temperature_hint(gaps: Mapping[str, float], tolerance: float, temperature: float,
                     cls: type) -> str:
    """What distribution the engine's log-probs are of, given their gap to each candidate.

    Args:
        gaps: Largest difference of the engine's log-probs to the reference's at
            `untempered` (T = 1) and `twice` (logits / T²).
        tolerance: The tolerance of the test.
        temperature: `EngineContext.temperature`.
        cls: The engine class.
    """
    method = own_method(cls, _FORWARD_METHODS)
    if gaps.get("twice", float("inf")) <= tolerance:
        return (f"the log-probs are log_softmax(logits / {temperature}²): tempered twice. "
                f"The toolkit already divides by EngineContext.temperature "
                f"(CausalLMTrainEngine.score); {method} must return the raw logits")
    if gaps.get("untempered", float("inf")) <= tolerance:
        return (f"the log-probs are log_softmax(logits) at T = 1: untempered. {method} must "
                f"divide the logits by EngineContext.temperature ({temperature})")
    return (f"{method} computes log-probs of neither log_softmax(logits / {temperature}) nor "
            f"a mistempered variant: a layout or masking bug")
