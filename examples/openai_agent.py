"""An agent loop written only with the `openai` client, trained by PeerFlow.

`examples/openai_agent.yaml` runs `run_episode` once per trajectory. PeerFlow gives it the
episode's `base_url` (the policy endpoint, on loopback), an `api_key` (the run's bearer
token) and the `model` name; every call it makes is sampled by the rollout engine and
recorded token-exactly as the trajectory the trainer trains on. The function is an
ordinary OpenAI agent: point the same code at any OpenAI-compatible server and it runs.

The loop: ask the question with one tool (`calculator`); run each tool call the model
makes — in PeerFlow's sandbox, the way the built-in tool environment does — and send the
results back; a turn without a call is the answer. An answer without a number gets one
more try. The reward: 1 when the answer's last number is the product, else half the
fraction of the product's digits it has right in place (partial credit, so a small model
gets a signal before it is ever exactly right).
"""

from __future__ import annotations

import json
import re
from typing import Any

from openai import OpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluates an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
MAX_TURNS = 3


def calculator(arguments: str) -> str:
    """Runs the built-in calculator tool on a call's JSON arguments, sandboxed."""
    from peerflow.agents.calculator import Calculator
    from peerflow.agents.tool_runner import run_tool
    from peerflow.sandbox.base import SandboxLimits

    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        return f"Error: the arguments are not JSON ({exc})"
    result = run_tool(Calculator(), parsed, SandboxLimits(timeout_s=10, memory_mb=512))
    return result.content


def last_number(text: str) -> str:
    """The last number in `text` (thousands separators dropped), or `""`."""
    numbers = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return numbers[-1].replace(",", "") if numbers else ""


def score(answer: str, product: str) -> float:
    """1 for the product, else half the fraction of its digits `answer` has in place."""
    if answer == product:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(answer, product)) / len(product)


def run_episode(base_url: str, api_key: str, model: str, example: dict[str, Any]) -> float:
    """Plays one episode against the endpoint; returns its reward in [0, 1]."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    prompt = example["prompt"]
    messages: list[dict[str, Any]] = (
        [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))
    for _ in range(MAX_TURNS):
        message = client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR]).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculator(call.function.arguments)})
            continue
        answer = last_number(message.content or "")
        if answer:
            return score(answer, str(example["answer"]))
        messages.append({"role": "user", "content": "Reply with the number only."})
    return 0.0
