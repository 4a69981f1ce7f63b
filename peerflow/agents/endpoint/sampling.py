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

from typing import Annotated, Any

import attrs
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from peerflow.agents.endpoint.limits import MAX_COUNT, MAX_SEED, RequestLimits
from peerflow.agents.environment import TurnSettings

#: Settings that change the sampled distribution, with the value that leaves it alone.
_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "min_p": 0.0, "logit_bias": None, "min_tokens": 0, "ignore_eos": False,
    "use_beam_search": False, "echo": False, "suffix": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "structured_outputs": None,
}


class FieldError(ValueError):
    """A request refused by a check that sees more than one field; names the one to fix."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def limits_of(info: ValidationInfo) -> RequestLimits:
    """The limits a request is validated against (none known: nothing model-specific)."""
    return info.context if isinstance(info.context, RequestLimits) else RequestLimits()


def _in_vocabulary(value: int, info: ValidationInfo) -> int:
    vocab = limits_of(info).vocab_size
    if vocab is not None and value >= vocab:
        raise ValueError(f"outside the model's vocabulary (ids 0 to {vocab - 1}); send ids "
                         "the run's tokenizer makes.")
    return value


#: A token id: an integer from 0 to the model's vocabulary size (`RequestLimits`).
TokenId = Annotated[int, Field(strict=True, ge=0), AfterValidator(_in_vocabulary)]
#: A token count (`max_tokens`): at least 1, at most the model's context.
Count = Annotated[int, Field(strict=True, ge=1, le=MAX_COUNT)]
#: Longest stop string a request may send (characters).
MAX_STOP_CHARS = 1024
#: A stop string: never empty (every engine raises on one, which failed the turn of every
#: trajectory sharing the call) and at most `MAX_STOP_CHARS` (the HF engine decodes a
#: window of four tokens per character after every sampled token).
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class SamplingFields(BaseModel):
    """A request's sampling settings (OpenAI's names and vLLM's), validated at the edge.

    Types, ranges and finiteness are checked here, and the model's and the run's limits
    (`RequestLimits`, pydantic's validation context): `n` at most the cap, token ids in
    the vocabulary, `max_tokens` within the context. Whether a valid setting can be
    honoured by this run is `refusal`'s question.
    """

    model_config = ConfigDict(extra="allow")

    n: int | None = Field(default=None, strict=True, ge=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, strict=True, ge=-1, le=MAX_COUNT)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=64)] | None = None
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=64)
    seed: int | None = Field(default=None, strict=True, ge=0, le=MAX_SEED)
    logprobs: bool | Annotated[int, Field(ge=0, le=20)] | None = None
    top_logprobs: int | None = Field(default=None, strict=True, ge=0, le=20)
    best_of: int | None = Field(default=None, strict=True, ge=1)
    response_format: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _capped(cls, value: int | None, info: ValidationInfo) -> int | None:
        limits = limits_of(info)
        if value is not None and limits.max_n is not None and value > limits.max_n:
            raise ValueError(f"more choices than one call may ask for ({limits.max_n}, "
                             f"{limits.max_n_setting}); ask for fewer or "
                             "raise rollout.agent.options.max_n.")
        return value

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _within_context(cls, value: int | None, info: ValidationInfo) -> int | None:
        context = limits_of(info).context
        if value is not None and context is not None and value > context:
            raise ValueError(f"past the model's context of {context} positions; ask for at "
                             "most that (answers are cut to the run's turn limit anyway).")
        return value

    @model_validator(mode="after")
    def _honourable(self) -> SamplingFields:
        problem = self._never_honoured()
        if problem is not None:
            raise problem
        return self

    def _never_honoured(self) -> FieldError | None:
        """The first distribution-changing setting that is set, as a refusal."""
        extra = self.model_extra or {}
        for name in _NEUTRAL:
            if name in extra and not _neutral(name, extra[name]):
                return FieldError(name, (
                    f"{name}={extra[name]!r} is not supported by the PeerFlow policy endpoint: "
                    "it changes the sampled distribution in a way the rollout engines report "
                    "no log-probs for, so the trainer could not train on the answer exactly; "
                    "leave it unset."))
        fmt = self.response_format or {}
        if fmt.get("type", "text") != "text":
            return FieldError("response_format", "response_format other than text (structured "
                              "output) is not supported: it constrains sampling; leave it unset.")
        if self.best_of is not None and self.best_of > (self.n or 1):
            return FieldError("best_of", f"best_of={self.best_of} is not supported (it ranks "
                              "and drops answers); ask for n choices instead.")
        return None


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


def sampling_of(kind: str, fields: SamplingFields) -> RequestSampling:
    """The settings of a validated request (`kind`: `chat`, `completion` or `generate`)."""
    logprobs = fields.logprobs
    top = fields.top_logprobs or 0
    if kind == "completion" and isinstance(logprobs, int) and not isinstance(logprobs, bool):
        top = max(top, logprobs - 1)  # the legacy field counts the sampled token too
    stop = fields.stop or ()
    return RequestSampling(
        n=fields.n or 1, temperature=fields.temperature, top_p=fields.top_p,
        top_k=fields.top_k, max_tokens=fields.max_completion_tokens or fields.max_tokens,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(fields.stop_token_ids or ()), seed=fields.seed,
        logprobs=bool(logprobs) or kind == "generate", top_logprobs=top)


def request_sampling(kind: str, raw: dict[str, Any],
                     limits: RequestLimits | None = None) -> RequestSampling:
    """Reads and validates a request body's sampling settings.

    Args:
        kind: `chat`, `completion` or `generate` (its settings sit in `sampling_params`).
        raw: The request body.
        limits: The model's and the run's limits (default: none known).

    Raises:
        ValueError: A malformed setting, or one that is never honoured (pydantic's
            `ValidationError`, naming it).
    """
    src = dict(raw.get("sampling_params") or {}) if kind == "generate" else raw
    return sampling_of(kind, SamplingFields.model_validate(src, context=limits))


def refusal(sampling: RequestSampling, run: Any, capabilities: Any) -> FieldError | None:
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
        return FieldError("temperature", (
            f"temperature={sampling.temperature} differs from the run's "
            f"rollout.sampling.temperature={run.temperature}: {why}. Send "
            f"temperature={run.temperature} or leave it unset (or change the run's)."))
    if sampling.top_p is not None and sampling.top_p != run.top_p:
        return FieldError("top_p", (
            f"top_p={sampling.top_p} differs from the run's rollout.sampling.top_p="
            f"{run.top_p}: {why}. Leave it unset (or change the run's)."))
    if sampling.top_k is not None and max(sampling.top_k, 0) != max(run.top_k, 0):
        return FieldError("top_k", (
            f"top_k={sampling.top_k} differs from the run's rollout.sampling.top_k="
            f"{run.top_k}: {why}. Leave it unset (or change the run's)."))
    if sampling.stop and not capabilities.stop_strings:
        return FieldError("stop", (
            f"stop={list(sampling.stop)!r}: the run's rollout engine does not honour stop "
            "strings (Capabilities.stop_strings); use stop_token_ids or leave it unset."))
    if sampling.logprobs and not capabilities.logprobs:
        return FieldError("logprobs", "logprobs: the run's rollout engine returns no "
                          "log-probs (Capabilities.logprobs); leave it unset.")
    if sampling.top_logprobs > 0:
        return FieldError("top_logprobs", (
            f"top_logprobs={sampling.top_logprobs}: the rollout engines return the sampled "
            "token's log-prob only; ask for logprobs without top_logprobs."))
    return None
