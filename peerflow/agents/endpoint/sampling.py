"""Per-request sampling settings of the policy endpoint: what is honoured, what is refused.

A request's settings are read into a `RequestSampling` (OpenAI's names, vLLM's extra
names, and the `sampling_params` of vLLM's token-in generate route), checked against the
run and the rollout engine when the driver takes the call (`refusal`), and handed to the
driver as the turn's `TurnSettings`:

* honoured: `n` (choices from one request), `max_tokens` / `max_completion_tokens` (at
  most `rollout.agent.max_turn_tokens`, else the run's `rollout.sampling.max_tokens`; a
  larger value is cut to it and the answer ends with `finish_reason` `length`), `stop`
  (with the engine's `Capabilities.stop_strings`), `stop_token_ids`, `seed`, `logprobs`
  (`Capabilities.logprobs`; the sampled token's log-prob);
* equal to the run's or refused: `temperature`, `top_p`, `top_k`. The trainer computes
  the new policy's log-probs at `rollout.sampling.temperature`, and the recorded
  log-probs are `log_softmax(logits / T)` at the temperature the engine sampled with, so a
  turn at another temperature (or truncation) would make the importance ratios compare
  two different distributions; such a request gets 400 naming the run's value (during
  the greedy evaluation pass, `eval.greedy`, nothing is trained: they are accepted and
  decoding stays greedy);
* refused: settings that change the sampled distribution in ways no rollout engine
  reports log-probs for (penalties, `logit_bias`, `min_p`, `min_tokens`, `ignore_eos`,
  beam search, `best_of`, `echo`, `suffix`, structured output), and `top_logprobs > 0`
  (engines return the sampled token's log-prob only).
"""

from __future__ import annotations

from typing import Any

import attrs

from peerflow.agents.environment import TurnSettings

#: Settings that change the sampled distribution, with the value that leaves it alone.
_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_p": 0.0, "logit_bias": None, "min_tokens": 0, "ignore_eos": False,
    "use_beam_search": False, "echo": False, "suffix": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "structured_outputs": None,
}


@attrs.frozen(kw_only=True)
class RequestSampling:
    """The sampling settings one call asked for (`None`: not given, the run's apply)."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def turn_settings(self) -> TurnSettings:
        """What the driver's turn asks of the sampler (`peerflow.agents.turns`)."""
        return TurnSettings(n=self.n, max_tokens=self.max_tokens, stop=self.stop,
                            stop_token_ids=self.stop_token_ids, seed=self.seed)


def _neutral(name: str, value: Any) -> bool:
    if value is None or value == _NEUTRAL[name]:
        return True
    if name == "logit_bias":
        return not value
    if name == "suffix":
        return value == ""
    return False


def request_sampling(kind: str, raw: dict[str, Any]) -> RequestSampling:
    """Reads a request body's sampling settings.

    Args:
        kind: `chat`, `completion` or `generate` (its settings sit in `sampling_params`).
        raw: The request body.

    Raises:
        ValueError: A setting that is never honoured, or a malformed one (the message
            names it and says why).
    """
    src = dict(raw.get("sampling_params") or {}) if kind == "generate" else raw
    for name, value in src.items():
        if name in _NEUTRAL and not _neutral(name, value):
            raise ValueError(
                f"{name}={value!r} is not supported by the PeerFlow policy endpoint: it changes "
                "the sampled distribution in a way the rollout engines report no log-probs "
                "for, so the trainer could not train on the answer exactly; leave it unset.")
    fmt = src.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise ValueError("response_format other than text (structured output) is not "
                         "supported: it constrains sampling; leave it unset.")
    n = 1 if src.get("n") is None else int(src["n"])
    best_of = src.get("best_of")
    if best_of is not None and int(best_of) > n:
        raise ValueError(f"best_of={best_of} is not supported (it ranks and drops answers); "
                         "ask for n choices instead.")
    limit = src.get("max_completion_tokens") or src.get("max_tokens")
    stop = src.get("stop") or ()
    logprobs = src.get("logprobs")
    top = int(src.get("top_logprobs") or 0)
    if kind == "completion" and isinstance(logprobs, int) and not isinstance(logprobs, bool):
        top = max(top, int(logprobs) - 1)  # the legacy field counts the sampled token too
    values = RequestSampling(
        n=n, temperature=_number(src, "temperature"), top_p=_number(src, "top_p"),
        top_k=None if src.get("top_k") is None else int(src["top_k"]),
        max_tokens=None if limit is None else int(limit),
        stop=(stop,) if isinstance(stop, str) else tuple(str(s) for s in stop),
        stop_token_ids=tuple(int(i) for i in src.get("stop_token_ids") or ()),
        seed=None if src.get("seed") is None else int(src["seed"]),
        logprobs=bool(logprobs) or kind == "generate", top_logprobs=top)
    if values.n < 1:
        raise ValueError(f"n={values.n}: ask for at least 1 choice.")
    if values.max_tokens is not None and values.max_tokens < 1:
        raise ValueError(f"max_tokens={values.max_tokens}: must be at least 1.")
    return values


def _number(src: dict[str, Any], name: str) -> float | None:
    return None if src.get(name) is None else float(src[name])


def refusal(sampling: RequestSampling, run: Any, capabilities: Any) -> str | None:
    """Why a call's settings cannot be honoured by this run and engine, or `None`.

    Args:
        sampling: The call's settings.
        run: The run's `SamplingParams` (`rollout.sampling`).
        capabilities: The rollout engine's `Capabilities`.
    """
    why = ("the trainer computes log-probs at the run's settings, so a turn sampled "
           "otherwise would train on the wrong importance ratios")
    if run.temperature == 0:  # greedy evaluation: nothing is trained, decoding stays greedy
        sampling = attrs.evolve(sampling, temperature=None, top_p=None, top_k=None)
    if sampling.temperature is not None and sampling.temperature != run.temperature:
        return (f"temperature={sampling.temperature} differs from the run's "
                f"rollout.sampling.temperature={run.temperature}: {why}. Send "
                f"temperature={run.temperature} or leave it unset (or change the run's).")
    if sampling.top_p is not None and sampling.top_p != run.top_p:
        return (f"top_p={sampling.top_p} differs from the run's rollout.sampling.top_p="
                f"{run.top_p}: {why}. Leave it unset (or change the run's).")
    if sampling.top_k is not None and max(sampling.top_k, 0) != max(run.top_k, 0):
        return (f"top_k={sampling.top_k} differs from the run's rollout.sampling.top_k="
                f"{run.top_k}: {why}. Leave it unset (or change the run's).")
    if sampling.stop and not capabilities.stop_strings:
        return (f"stop={list(sampling.stop)!r}: the run's rollout engine does not honour stop "
                "strings (Capabilities.stop_strings); use stop_token_ids or leave it unset.")
    if sampling.logprobs and not capabilities.logprobs:
        return ("logprobs: the run's rollout engine returns no log-probs "
                "(Capabilities.logprobs); leave it unset.")
    if sampling.top_logprobs > 0:
        return (f"top_logprobs={sampling.top_logprobs}: the rollout engines return the "
                "sampled token's log-prob only; ask for logprobs without top_logprobs.")
    return None
