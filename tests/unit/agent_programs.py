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
