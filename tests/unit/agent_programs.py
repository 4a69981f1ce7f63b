"""Agent programs the policy-endpoint tests run: written only with the `openai` client.

Each records what the endpoint answered (`RECORDS`), so a test can compare it with the
batch the trainer receives.
"""

from __future__ import annotations

import threading
from typing import Any

RECORDS: list[list[dict[str, Any]]] = []
_LOCK = threading.Lock()
TOOLS = [{"type": "function", "function": {
    "name": "count", "description": "Counts the characters of a text.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                   "required": ["text"]}}}]


def _client(base_url: str, api_key: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)


def chat_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """Three chat turns with one tool; each answer's length is reported back by the tool."""
    client = _client(base_url, api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": example["prompt"]}]
    calls: list[dict[str, Any]] = []
    try:
        for turn in range(3):
            response = client.chat.completions.create(
                model=model, messages=messages, tools=TOOLS, logprobs=True,
                extra_body={"return_token_ids": True})
            choice = response.choices[0]
            calls.append({"prompt": response.prompt_token_ids, "ids": choice.token_ids,
                          "logprobs": [c.logprob for c in choice.logprobs.content],
                          "text": choice.message.content})
            messages.append({"role": "assistant", "content": choice.message.content})
            # The one tool: the agent runs `count` on the answer and sends the result.
            messages.append({"role": "tool", "tool_call_id": f"t{turn}",
                             "content": str(len(choice.message.content or ""))})
    finally:
        with _LOCK:
            RECORDS.append(calls)
    return float(len(calls[-1]["ids"]) % 2)


def completion_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]
                     ) -> dict[str, float]:
    """A text completion, then vLLM's token-in generate continuing it by one token."""
    import httpx

    client = _client(base_url, api_key)
    first = client.completions.create(model=model, prompt=example["prompt"], logprobs=1,
                                      extra_body={"return_token_ids": True})
    choice = first.choices[0]
    sequence = list(choice.prompt_token_ids) + list(choice.token_ids) + [5]
    root = base_url.removesuffix("/v1")
    second = httpx.post(f"{root}/inference/v1/generate", timeout=120,
                        headers={"Authorization": f"Bearer {api_key}"},
                        json={"token_ids": sequence, "sampling_params": {"max_tokens": 4}})
    second.raise_for_status()
    body = second.json()
    with _LOCK:
        RECORDS.append([
            {"prompt": choice.prompt_token_ids, "ids": choice.token_ids,
             "logprobs": choice.logprobs.token_logprobs},
            {"prompt": body["prompt_token_ids"], "ids": body["choices"][0]["token_ids"],
             "logprobs": [c["logprob"] for c in body["choices"][0]["logprobs"]["content"]]}])
    return {"format": 0.5, "length": float(len(body["choices"][0]["token_ids"]) > 0)}


def rewriting_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]
                    ) -> float:
    """Rewrites its first answer before the second call: a new sample must start there."""
    client = _client(base_url, api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": example["prompt"]}]
    first = client.chat.completions.create(model=model, messages=messages,
                                           extra_body={"return_token_ids": True})
    messages += [{"role": "assistant", "content": "rewritten " + str(first.choices[0]
                                                                   .message.content)},
                 {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model=model, messages=messages, logprobs=True,
                                            extra_body={"return_token_ids": True})
    with _LOCK:
        RECORDS.append([{"prompt": r.prompt_token_ids, "ids": r.choices[0].token_ids}
                        for r in (first, second)])
    return 1.0


def endless_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """Keeps calling until the endpoint says the trajectory ended; then returns 0.75."""
    from openai import APIStatusError

    client = _client(base_url, api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": example["prompt"]}]
    while True:
        try:
            response = client.chat.completions.create(model=model, messages=messages)
        except APIStatusError as exc:
            with _LOCK:
                RECORDS.append([{"status": exc.status_code}])
            return 0.75
        messages += [{"role": "assistant", "content": response.choices[0].message.content},
                     {"role": "user", "content": "more"}]


def _stream(client: Any, **request: Any) -> dict[str, Any]:
    """One streamed call, rebuilt from its chunks as a client does."""
    text, ids, logprobs, prompt, usage, finish = "", [], [], None, None, None
    for chunk in client.create(stream=True, stream_options={"include_usage": True},
                               logprobs=True, extra_body={"return_token_ids": True},
                               **request):
        prompt = prompt or getattr(chunk, "prompt_token_ids", None)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            prompt = prompt or getattr(choice, "prompt_token_ids", None)
            delta = getattr(choice, "delta", None)
            text += (delta.content or "") if delta is not None else (choice.text or "")
            ids += getattr(choice, "token_ids", None) or []
            if choice.logprobs is not None:
                logprobs += ([c.logprob for c in choice.logprobs.content] if delta is not None
                             else list(choice.logprobs.token_logprobs))
            finish = choice.finish_reason or finish
    return {"prompt": prompt, "ids": ids, "logprobs": logprobs, "text": text,
            "usage": usage.model_dump() if usage else None, "finish": finish}


def stream_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """Two streamed chat turns, then a streamed completion continuing the token sequence."""
    client = _client(base_url, api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": example["prompt"]}]
    calls = []
    for turn in range(2):
        calls.append(_stream(client.chat.completions, model=model, messages=messages))
        messages += [{"role": "assistant", "content": calls[-1]["text"]},
                     {"role": "user", "content": f"again {turn}"}]
    # The chat turn's text as a completion: the trajectory's tokens, then one more token.
    sequence = calls[-1]["prompt"] + calls[-1]["ids"] + [5]
    calls.append(_stream(client.completions, model=model, prompt=sequence))
    with _LOCK:
        RECORDS.append(calls)
    return 1.0


def choices_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """Asks for 3 choices, goes on with the last one, then one more turn."""
    client = _client(base_url, api_key)
    messages: list[dict[str, Any]] = [{"role": "user", "content": example["prompt"]}]
    first = client.chat.completions.create(model=model, messages=messages, n=3, logprobs=True,
                                           extra_body={"return_token_ids": True})
    picked = first.choices[2]
    messages += [{"role": "assistant", "content": picked.message.content},
                 {"role": "user", "content": "and?"}]
    second = client.chat.completions.create(model=model, messages=messages, logprobs=True,
                                            extra_body={"return_token_ids": True})
    with _LOCK:
        RECORDS.append([{"prompt": first.prompt_token_ids, "ids": c.token_ids,
                         "logprobs": [e.logprob for e in c.logprobs.content],
                         "text": c.message.content} for c in first.choices]
                       + [{"prompt": second.prompt_token_ids,
                           "ids": second.choices[0].token_ids,
                           "logprobs": [e.logprob for e in second.choices[0].logprobs.content],
                           "usage": first.usage.completion_tokens}])
    return 0.5


def sampling_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """Sends settings the run must refuse (each answered 400), then ones it honours."""
    from openai import BadRequestError

    client = _client(base_url, api_key)
    messages = [{"role": "user", "content": example["prompt"]}]
    refused = []
    for bad in ({"temperature": 0.5}, {"top_p": 0.9}, {"top_logprobs": 2, "logprobs": True},
                {"presence_penalty": 0.5}, {"extra_body": {"min_p": 0.1}}):
        try:
            client.chat.completions.create(model=model, messages=messages, **bad)
        except BadRequestError as exc:
            refused.append(str(exc))
    answer = client.chat.completions.create(
        model=model, messages=messages, temperature=1.0, max_completion_tokens=2, seed=11,
        stop=["zz"], logprobs=True,
        extra_body={"return_token_ids": True, "top_k": -1, "repetition_penalty": 1.0})
    choice = answer.choices[0]
    with _LOCK:
        RECORDS.append([{"prompt": answer.prompt_token_ids, "ids": choice.token_ids,
                         "logprobs": [e.logprob for e in choice.logprobs.content],
                         "finish": choice.finish_reason, "refused": refused}])
    return 1.0


_STARTS: dict[str, int] = {}


def early_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """Some episodes fail before their first call: raise, return, or wait too long."""
    import time

    with _LOCK:
        k = _STARTS[example["prompt"]] = _STARTS.get(example["prompt"], -1) + 1
    fate = {("1+2=", 0): "return", ("ab", 0): "raise", ("ab", 1): "hang"}.get(
        (example["prompt"], k))
    if fate == "raise":
        raise ValueError("no model for me")
    if fate == "return":
        return 1.0
    if fate == "hang":
        time.sleep(4.0)
        return 1.0
    client = _client(base_url, api_key)
    client.chat.completions.create(model=model, messages=[{"role": "user",
                                                           "content": example["prompt"]}])
    return 0.25


def session_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """Two chat turns on the plain /v1 routes, the episode named in X-Session-Id."""
    from openai import OpenAI

    root, episode = base_url.split("/episodes/")
    client = OpenAI(base_url=f"{root}/v1", api_key=api_key, max_retries=0, timeout=120,
                    default_headers={"X-Session-Id": episode.removesuffix("/v1")})
    messages: list[dict[str, Any]] = [{"role": "user", "content": example["prompt"]}]
    for _ in range(2):
        answer = client.chat.completions.create(model=model, messages=messages)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "more"}]
    return 1.0


#: The malformed calls `hostile_agent` sends before its one good call: (route, body).
ATTACKS: list[tuple[str, dict[str, Any]]] = []


def hostile_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """Sends every call of `ATTACKS`, then one good chat call; records each answer."""
    import httpx

    root = base_url.removesuffix("/v1")
    paths = {"chat": f"{base_url}/chat/completions", "completion": f"{base_url}/completions",
             "generate": f"{root}/inference/v1/generate"}
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    answers = []
    with httpx.Client(timeout=120, headers=headers) as client:
        for route, body in ATTACKS:
            import json

            sent = client.post(paths[route], content=json.dumps(body))  # NaN stays NaN
            answers.append({"status": sent.status_code, "body": sent.json()})
        good = client.post(paths["chat"], json={"model": model, "messages": [
            {"role": "user", "content": example["prompt"]}], "max_tokens": 3})
        answers.append({"status": good.status_code, "body": good.json()})
    with _LOCK:
        RECORDS.append(answers)
    return 1.0


def engine_failure_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]
                         ) -> float:
    """One chat call; records its status (500 where the engine failed on its prompt)."""
    from openai import APIStatusError

    client = _client(base_url, api_key)
    try:
        client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": example["prompt"]}], max_tokens=3)
        status = 200
    except APIStatusError as exc:
        status = exc.status_code
        with _LOCK:
            RECORDS.append([{"prompt": example["prompt"], "status": status,
                             "message": exc.body}])
        raise
    with _LOCK:
        RECORDS.append([{"prompt": example["prompt"], "status": status}])
    return 1.0


#: What `stamped_agent`'s episodes of the stamped row were told: (status, message) per call.
TOLD: list[tuple[int, str]] = []


def stamped_agent(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """A timestamp in the system prompt of row "ab": its group's first calls differ."""
    import time

    import openai

    client = _client(base_url, api_key)
    system = f"Now: {time.time_ns()}." if example["prompt"] == "ab" else "Answer."
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": example["prompt"]}]
    for _ in range(2):  # the first call, then one more after the refusal
        try:
            client.chat.completions.create(model=model, messages=messages)
        except openai.APIStatusError as exc:
            with _LOCK:
                TOLD.append((exc.status_code, str(exc.body)))
            continue
        return 0.5
    return 0.0
