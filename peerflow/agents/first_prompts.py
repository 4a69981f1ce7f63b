"""An episode's first prompt, and the checks a group's first prompts must pass.

The driver (`peerflow.agents.rollout`) renders every episode's first prompt at once, then
checks each group (the `n` episodes of one draw) before anything is sampled. A group that
fails a check ends alone — every episode `env_error`, the reason in `agent_error`, the
environment told through `Environment.turn_failed` — and the batch goes on:

* the `n` first prompts differ (GRPO compares the `n` answers to one prompt; a timestamp
  or a random id in a system prompt is enough to break it);
* the first prompt and the turn's tokens do not fit the model's context (its
  `max_position_embeddings`): no engine can answer it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from peerflow.agents.environment import Environment
from peerflow.rollout.prompts import encode_prompt

#: `agent_errors.jsonl`'s type of a group whose first prompts differ.
DIVERGED = "DivergentFirstPrompts"
#: `agent_errors.jsonl`'s type of a first prompt past the model's context.
TOO_LONG = "PromptPastContext"


def first_prompt(tokenizer: Any, env: Environment) -> list[int]:
    """The token ids of an episode's first prompt, with the environment's tool schemas."""
    ids = env.initial_prompt_ids(tokenizer)
    if ids is not None:
        return [int(i) for i in ids]
    prompt = env.initial_prompt()
    schemas = env.tool_schemas()
    if not schemas:
        return encode_prompt(tokenizer, prompt)
    from peerflow.agents.tools import render_prompt

    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return render_prompt(tokenizer, messages, schemas)


def model_context(tokenizer: Any) -> int | None:
    """The model's positions (`max_position_embeddings`), found from the tokenizer's path."""
    from peerflow.agents.endpoint.limits import model_limits

    return model_limits(tokenizer, None, 0).context


def divergence(prompts: Sequence[Sequence[int]], env_name: str, row: str) -> str:
    """Why a group's first prompts cannot start it, or an empty string when they agree."""
    first = list(prompts[0]) if prompts else []
    other = next((list(p) for p in prompts if list(p) != first), None)
    if other is None:
        return ""
    at = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b),
              min(len(first), len(other)))
    return (f"environment {env_name!r} gave the {len(prompts)} episodes of {row} different "
            f"first prompts ({len(first)} and {len(other)} tokens, first different at token "
            f"{at}); a group's episodes answer one prompt (GRPO compares them), so the first "
            "prompt (an agent program's first call) must depend on the example only — a "
            "timestamp or a random id in the system prompt is enough to break it. The "
            "group is left out; randomise later turns instead.")


def past_context(prompt_tokens: int, answer_tokens: int, context: int | None) -> str:
    """Why a first prompt cannot be answered within the model's context, or ``""``."""
    if context is None or prompt_tokens + answer_tokens <= context:
        return ""
    return (f"the first prompt has {prompt_tokens} tokens; with the turn's {answer_tokens} "
            f"tokens to sample it exceeds the model's context of {context} positions "
            "(max_position_embeddings), so no answer can be sampled. Shorten the example's "
            "prompt (or the environment's opening, system prompt or tool schemas), or lower "
            "rollout.sampling.max_tokens / rollout.agent.max_turn_tokens.")
