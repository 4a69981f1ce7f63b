"""Request and response bodies of the policy endpoint (OpenAI's and vLLM's shapes).

Requests are validated with pydantic (unknown fields are accepted and ignored, as OpenAI
clients send many); each becomes a `Call`: what the model is asked to continue. Responses
are plain dicts in OpenAI's shapes, plus vLLM's token fields when `return_token_ids` is set
(`prompt_token_ids`, `token_ids`), and log-probs when `logprobs` is set.

Sampling settings in a request (`temperature`, `top_p`, `max_tokens`, …) are accepted and
not used: during training the run's `rollout.sampling` applies (the trainer computes its
log-probs at that temperature), and `rollout.agent.max_turn_tokens` bounds a turn.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import attrs
from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = ""
    n: int = 1
    stream: bool = False
    logprobs: bool | int | None = None
    return_token_ids: bool = False


class ChatRequest(_Request):
    """`POST …/v1/chat/completions`."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class CompletionRequest(_Request):
    """`POST …/v1/completions`: a text prompt or a list of token ids."""

    prompt: str | list[int]


class GenerateRequest(_Request):
    """`POST …/inference/v1/generate` (vLLM's token-in route)."""

    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)


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
    logprobs: bool = False
    return_token_ids: bool = False
    model: str = ""


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
        ValueError: `n` other than 1, or `stream` (each message names the fix).
    """
    if body.n != 1:
        raise ValueError("n must be 1: an episode is one trajectory; PeerFlow samples a "
                         "group by running rollout.sampling.n episodes of each prompt.")
    if body.stream:
        raise ValueError("stream is not supported by the PeerFlow policy endpoint; send the "
                         "request with stream=false.")
    common = {"logprobs": bool(body.logprobs), "return_token_ids": body.return_token_ids,
              "model": body.model}
    if isinstance(body, ChatRequest):
        return Call(kind=kind, messages=tuple(normal_message(m) for m in body.messages),
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


def _usage(reply: Reply) -> dict[str, int]:
    prompt, completion = len(reply.prompt_ids), len(reply.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _pieces(tokenizer: Any, ids: tuple[int, ...]) -> list[str]:
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def chat_response(call: Call, reply: Reply, message: dict[str, Any], finish: str,
                  tokenizer: Any) -> dict[str, Any]:
    """An OpenAI `chat.completion` body (vLLM's `prompt_token_ids`/`token_ids` when asked)."""
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish,
                              "logprobs": None}
    if call.logprobs:
        choice["logprobs"] = {"content": [
            {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
            for piece, lp in zip(_pieces(tokenizer, reply.token_ids), reply.logprobs)]}
    body: dict[str, Any] = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                            "created": int(time.time()), "model": call.model,
                            "choices": [choice], "usage": _usage(reply)}
    if call.return_token_ids:
        choice["token_ids"] = list(reply.token_ids)
        body["prompt_token_ids"] = list(reply.prompt_ids)
    return body


def completion_response(call: Call, reply: Reply, tokenizer: Any) -> dict[str, Any]:
    """An OpenAI `text_completion` body (vLLM's token fields in the choice when asked)."""
    choice: dict[str, Any] = {"index": 0, "text": reply.text,
                              "finish_reason": reply.finish_reason, "logprobs": None}
    if call.logprobs:
        pieces = _pieces(tokenizer, reply.token_ids)
        offsets = [sum(len(p) for p in pieces[:k]) for k in range(len(pieces))]
        choice["logprobs"] = {"tokens": pieces, "token_logprobs": list(reply.logprobs),
                              "text_offset": offsets, "top_logprobs": None}
    if call.return_token_ids:
        choice["token_ids"] = list(reply.token_ids)
        choice["prompt_token_ids"] = list(reply.prompt_ids)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": call.model, "choices": [choice],
            "usage": _usage(reply)}


def generate_response(call: Call, reply: Reply) -> dict[str, Any]:
    """The body of vLLM's `/inference/v1/generate`: token ids, log-probs, the prompt's ids."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reply.finish_reason,
                              "token_ids": list(reply.token_ids),
                              "logprobs": {"content": [{"token_id": i, "logprob": lp}
                                                       for i, lp in zip(reply.token_ids,
                                                                        reply.logprobs)]}}
    return {"request_id": f"gen-{uuid.uuid4().hex}", "model": call.model,
            "choices": [choice], "prompt_token_ids": list(reply.prompt_ids),
            "usage": _usage(reply)}


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape (`error.message`, which the `openai` client raises with)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
