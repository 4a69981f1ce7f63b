"""Request and response bodies of the policy endpoint (OpenAI's and vLLM's shapes).

Requests are validated with pydantic (unknown fields are accepted and ignored, as OpenAI
clients send many) against the model's and the run's limits (`limits.RequestLimits`, the
validation context): types, ranges, token ids in the vocabulary, prompts that fit the
context, `n` at most the cap. A refused request is answered 400 naming the field
(`refused_field`: OpenAI's `error.param`). Each valid one becomes a `Call`: what the
model is asked to continue. Responses
are plain dicts in OpenAI's shapes, plus vLLM's token fields when `return_token_ids` is set
(`prompt_token_ids`, `token_ids`), and log-probs when `logprobs` is set.

Sampling settings in a request are read by `peerflow.agents.endpoint.sampling` (what is
honoured, what must equal the run's, what is refused); `stream: true` answers in OpenAI's
server-sent-event chunks (`peerflow.agents.endpoint.stream`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import attrs
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from peerflow.agents.endpoint.sampling import (
    FieldError,
    RequestSampling,
    SamplingFields,
    TokenId,
    limits_of,
    sampling_of,
)


class _Request(SamplingFields):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    session_id: str | None = None

    @staticmethod
    def _fits(param: str, ids: list[int], sampling: SamplingFields, info: ValidationInfo
              ) -> None:
        """Refuses a token prompt the model's context cannot answer (names `param`)."""
        why = limits_of(info).room(len(ids),
                                   sampling.max_completion_tokens or sampling.max_tokens)
        if why:
            raise FieldError(param, f"{param}: {why}")


class _Function(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = ""


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: str = "function"
    function: _Function


class Message(BaseModel):
    """One chat message: a role, text (or text parts), tool calls and their answers."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(_Request):
    """`POST …/v1/chat/completions`.

    Its prompt's length is checked against the context when the episode renders it.
    """

    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Request):
    """`POST …/v1/completions`: a text prompt or a list of token ids."""

    prompt: str | list[TokenId] = Field(min_length=1)

    @model_validator(mode="after")
    def _prompt_fits(self, info: ValidationInfo) -> CompletionRequest:
        if isinstance(self.prompt, list):
            self._fits("prompt", self.prompt, self, info)
        return self


class GenerateRequest(_Request):
    """`POST …/inference/v1/generate` (vLLM's token-in route)."""

    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: SamplingFields = Field(default_factory=SamplingFields)

    @model_validator(mode="after")
    def _prompt_fits(self, info: ValidationInfo) -> GenerateRequest:
        self._fits("token_ids", self.token_ids, self.sampling_params, info)
        return self


#: Type tags pydantic puts in an error's location (a union's member), not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


def refused_field(error: ValidationError) -> tuple[str | None, str]:
    """The field a refused request must fix (OpenAI's `param`), and why.

    The most specific of pydantic's errors is named: its location with the union-member
    tags left out (`messages.0.content`, `token_ids.3`, `sampling_params.seed`), or the
    field a check across fields names (`FieldError`).
    """
    errors = error.errors(include_url=False)
    first = max(errors, key=lambda e: len(e["loc"]))
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return cause.param, str(cause)
    loc = [str(p) for p in first["loc"]
           if not (isinstance(p, str) and (not p.isidentifier() or p in _TYPE_TAGS))]
    param = ".".join(loc) or None
    message = str(first["msg"]).removeprefix("Value error, ")
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return param, f"{param}={shown}: {message}" if param else message


@attrs.frozen(kw_only=True)
class Call:
    """One model call of an episode, as the endpoint received it."""

    kind: str
    """`chat`, `completion` or `generate`."""
    messages: tuple[dict[str, Any], ...] = ()
    """Chat messages, normalised (`normal_message`)."""
    tools: tuple[dict[str, Any], ...] = ()
    text: str | None = None
    """A completion's text prompt."""
    ids: tuple[int, ...] | None = None
    """A completion's or generate call's prompt token ids."""
    sampling: RequestSampling = attrs.field(factory=RequestSampling)
    return_token_ids: bool = False
    model: str = ""
    stream: bool = False
    include_usage: bool = False
    """`stream_options.include_usage`: a last chunk with the usage."""
    token_id_pieces: bool = False
    """vLLM's `return_tokens_as_token_ids`: log-prob tokens spelled `token_id:<id>`."""
    skip_special_tokens: bool = True
    """Whether answer text leaves special tokens out (vLLM's default, true)."""

    @property
    def logprobs(self) -> bool:
        """Whether the answer carries each sampled token's log-prob."""
        return self.sampling.logprobs


def _text(content: Any) -> str:
    """Message content as text (a list of `{type: text, text}` parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    raise ValueError(f"message content must be text or text parts, got {type(content).__name__}")


def normal_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its content as text and empty fields dropped (for comparing turns)."""
    out: dict[str, Any] = {"role": str(message.get("role", "")),
                           "content": _text(message.get("content"))}
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    if "tool_calls" in out:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": c["function"]["arguments"]}}
                             for c in out["tool_calls"]]
    return out


def to_call(kind: str, body: _Request) -> Call:
    """The `Call` a validated request body asks for.

    Raises:
        FieldError: `stream` on the token-in generate route (the message names the fix).
    """
    if body.stream and kind == "generate":
        raise FieldError("stream", "stream is not supported on /inference/v1/generate "
                         "(vLLM's token-in route answers whole); send stream=false or use "
                         "/v1/completions.")
    fields = body.sampling_params if isinstance(body, GenerateRequest) else body
    common = {"sampling": sampling_of(kind, fields), "return_token_ids": body.return_token_ids,
              "model": body.model, "stream": body.stream,
              "include_usage": bool((body.stream_options or {}).get("include_usage")),
              "token_id_pieces": body.return_tokens_as_token_ids,
              "skip_special_tokens": body.skip_special_tokens}
    if isinstance(body, ChatRequest):
        return Call(kind=kind, messages=tuple(normal_message(m.model_dump(exclude_none=True))
                                              for m in body.messages),
                    tools=tuple(body.tools or ()), **common)
    if isinstance(body, CompletionRequest):
        if isinstance(body.prompt, str):
            return Call(kind=kind, text=body.prompt, **common)
        return Call(kind=kind, ids=tuple(body.prompt), **common)
    assert isinstance(body, GenerateRequest)
    return Call(kind=kind, ids=tuple(body.token_ids), **common)


@attrs.frozen(kw_only=True)
class Reply:
    """What the model sampled for a call, in the engine's own tokens."""

    prompt_ids: tuple[int, ...]
    """The whole token sequence the model continued (the trajectory so far)."""
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str
    """`stop` or `length`."""
    weight_version: int = 0


def usage(replies: list[Reply]) -> dict[str, int]:
    """OpenAI's usage of one call: its prompt once, every choice's tokens."""
    prompt = len(replies[0].prompt_ids)
    completion = sum(len(r.token_ids) for r in replies)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def pieces(call: Call, tokenizer: Any, ids: tuple[int, ...]) -> list[str]:
    """Each token as log-prob entries name it (`token_id:<id>` when asked, vLLM's way)."""
    if call.token_id_pieces:
        return [f"token_id:{i}" for i in ids]
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def chat_logprobs(call: Call, tokenizer: Any, ids: tuple[int, ...],
                  logprobs: tuple[float, ...]) -> dict[str, Any]:
    """A chat choice's `logprobs` (`content`: one entry per sampled token)."""
    return {"content": [{"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                         "top_logprobs": []}
                        for piece, lp in zip(pieces(call, tokenizer, ids), logprobs)]}


def completion_logprobs(call: Call, tokenizer: Any, ids: tuple[int, ...],
                        logprobs: tuple[float, ...], start: int = 0) -> dict[str, Any]:
    """A completion choice's legacy `logprobs` (offsets from `start`)."""
    names = pieces(call, tokenizer, ids)
    offsets = [start + sum(len(p) for p in names[:k]) for k in range(len(names))]
    return {"tokens": names, "token_logprobs": list(logprobs), "text_offset": offsets,
            "top_logprobs": None}


def chat_response(call: Call, replies: list[Reply], messages: list[tuple[dict[str, Any], str]],
                  tokenizer: Any) -> dict[str, Any]:
    """An OpenAI `chat.completion` body, one choice per reply.

    vLLM's `prompt_token_ids` and each choice's `token_ids` when asked.
    """
    choices = []
    for index, (reply, (message, finish)) in enumerate(zip(replies, messages)):
        choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish,
                                  "logprobs": None}
        if call.logprobs:
            choice["logprobs"] = chat_logprobs(call, tokenizer, reply.token_ids, reply.logprobs)
        if call.return_token_ids:
            choice["token_ids"] = list(reply.token_ids)
        choices.append(choice)
    body: dict[str, Any] = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                            "created": int(time.time()), "model": call.model,
                            "choices": choices, "usage": usage(replies)}
    if call.return_token_ids:
        body["prompt_token_ids"] = list(replies[0].prompt_ids)
    return body


def completion_response(call: Call, replies: list[Reply], tokenizer: Any) -> dict[str, Any]:
    """An OpenAI `text_completion` body (vLLM's token fields in each choice when asked)."""
    choices = []
    for index, reply in enumerate(replies):
        choice: dict[str, Any] = {"index": index, "text": reply.text,
                                  "finish_reason": reply.finish_reason, "logprobs": None}
        if call.logprobs:
            choice["logprobs"] = completion_logprobs(call, tokenizer, reply.token_ids,
                                                     reply.logprobs)
        if call.return_token_ids:
            choice["token_ids"] = list(reply.token_ids)
            choice["prompt_token_ids"] = list(reply.prompt_ids)
        choices.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": call.model, "choices": choices,
            "usage": usage(replies)}


def generate_response(call: Call, replies: list[Reply]) -> dict[str, Any]:
    """The body of vLLM's `/inference/v1/generate`: token ids, log-probs, the prompt's ids."""
    choices = [{"index": index, "finish_reason": reply.finish_reason,
                "token_ids": list(reply.token_ids),
                "logprobs": {"content": [{"token_id": i, "logprob": lp}
                                         for i, lp in zip(reply.token_ids, reply.logprobs)]}}
               for index, reply in enumerate(replies)]
    return {"request_id": f"gen-{uuid.uuid4().hex}", "model": call.model,
            "choices": choices, "prompt_token_ids": list(replies[0].prompt_ids),
            "usage": usage(replies)}


def error_body(message: str, kind: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (`error.message`, which the `openai` client raises with).

    Args:
        message: What is wrong and the fix.
        kind: `invalid_request_error` (400), `authentication_error` (401) or
            `server_error` (500).
        param: The request field to fix (`None`: not one field).
    """
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}
