"""`stream: true`: an answer as OpenAI's server-sent-event chunks.

The driver samples a turn whole (in its batched engine call), so a streamed answer is
sent once the turn is sampled: one chunk per sampled token (its text delta, and its token
id and log-prob when asked, as vLLM streams them), then a chunk with the `finish_reason`,
a usage chunk when `stream_options.include_usage` is set, and `data: [DONE]`. The text
deltas of a choice concatenate to exactly the text the non-streamed answer carries, so a
client that rebuilds the message sends back the same history, and the call is recorded
token-exactly as a non-streamed one (the recording never depends on the answer's shape).
Chat answers with tool calls stream the content, then the calls in one delta.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from peerflow.agents.endpoint.protocol import (
    Call,
    Reply,
    chat_logprobs,
    completion_logprobs,
    usage,
)


def text_deltas(text: str, ids: tuple[int, ...], tokenizer: Any, skip_special: bool
                ) -> list[str]:
    """One text delta per token; they concatenate to `text` exactly.

    Tokens are decoded incrementally (a delta is held back while it ends in an incomplete
    character); a delta is cut where the decoded text leaves `text` (a tool call's block
    after the content), and whatever is left goes with the last token.
    """
    deltas, decoded, sent = [], "", 0
    prefix, read = 0, 0
    for k in range(len(ids)):
        before = tokenizer.decode(list(ids[prefix:read]), skip_special_tokens=skip_special)
        now = tokenizer.decode(list(ids[prefix:k + 1]), skip_special_tokens=skip_special)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            decoded += now[len(before):]
            prefix, read = read, k + 1
        upto = sent
        if text.startswith(decoded):
            upto = len(decoded)
        elif decoded.startswith(text):
            upto = len(text)
        deltas.append(text[sent:upto] if upto > sent else "")
        sent = max(sent, upto)
    if deltas:
        deltas[-1] += text[sent:]
    return deltas


def _frame(call: Call, kind: str, ident: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"id": ident, "object": kind, "created": int(time.time()),
                            "model": call.model, "choices": choices}
    if call.include_usage:
        body["usage"] = None
    return body


def _usage_chunk(call: Call, kind: str, ident: str, replies: list[Reply]) -> dict[str, Any]:
    return {**_frame(call, kind, ident, []), "usage": usage(replies)}


def chat_chunks(call: Call, replies: list[Reply], messages: list[tuple[dict[str, Any], str]],
                tokenizer: Any) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` events of a chat answer, choice after choice."""
    kind, ident = "chat.completion.chunk", f"chatcmpl-{uuid.uuid4().hex}"
    events = []
    for index, (reply, (message, finish)) in enumerate(zip(replies, messages)):
        head = _frame(call, kind, ident, [{"index": index, "delta": {
            "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        if call.return_token_ids and index == 0:
            head["prompt_token_ids"] = list(reply.prompt_ids)
        events.append(head)
        content = message.get("content") or ""
        deltas = text_deltas(content, reply.token_ids, tokenizer, call.skip_special_tokens)
        for token, lp, delta in zip(reply.token_ids, reply.logprobs, deltas):
            choice: dict[str, Any] = {"index": index, "delta": {"content": delta},
                                      "logprobs": None, "finish_reason": None}
            if call.logprobs:
                choice["logprobs"] = chat_logprobs(call, tokenizer, (token,), (lp,))
            if call.return_token_ids:
                choice["token_ids"] = [token]
            events.append(_frame(call, kind, ident, [choice]))
        if message.get("tool_calls"):
            calls = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
            events.append(_frame(call, kind, ident, [{"index": index, "delta": {
                "tool_calls": calls}, "logprobs": None, "finish_reason": None}]))
        events.append(_frame(call, kind, ident, [{"index": index, "delta": {},
                                                  "logprobs": None, "finish_reason": finish}]))
    if call.include_usage:
        events.append(_usage_chunk(call, kind, ident, replies))
    return events


def completion_chunks(call: Call, replies: list[Reply], tokenizer: Any
                      ) -> list[dict[str, Any]]:
    """The `text_completion` events of a completion answer, choice after choice."""
    kind, ident = "text_completion", f"cmpl-{uuid.uuid4().hex}"
    events = []
    for index, reply in enumerate(replies):
        deltas = text_deltas(reply.text, reply.token_ids, tokenizer, call.skip_special_tokens)
        offset = 0
        for k, (token, lp, delta) in enumerate(zip(reply.token_ids, reply.logprobs, deltas)):
            choice: dict[str, Any] = {"index": index, "text": delta, "logprobs": None,
                                      "finish_reason": None}
            if call.logprobs:
                choice["logprobs"] = completion_logprobs(call, tokenizer, (token,), (lp,),
                                                         start=offset)
            if call.return_token_ids:
                choice["token_ids"] = [token]
                if k == 0:
                    choice["prompt_token_ids"] = list(reply.prompt_ids)
            offset += len(delta)
            events.append(_frame(call, kind, ident, [choice]))
        events.append(_frame(call, kind, ident, [{"index": index, "text": "", "logprobs": None,
                                                  "finish_reason": reply.finish_reason}]))
    if call.include_usage:
        events.append(_usage_chunk(call, kind, ident, replies))
    return events
