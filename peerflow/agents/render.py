"""Observations as tokens: chat-template continuations that never re-tokenise earlier turns.

A trajectory is one growing token sequence. Re-rendering the whole conversation with the
chat template after every turn would re-tokenise the model's earlier turns from their
decoded text, which is not always the sampled tokens: templates trim or rewrite assistant
content, special tokens the model sampled are dropped by decoding, BPE may merge the text
differently. The trainer would then score tokens that were never sampled.

`TurnRenderer.observation` renders only the new messages, as the template would write them
after an assistant turn: it renders a fixed dummy conversation `[user, assistant]` once,
then the same conversation followed by the new messages (with the generation prompt), and
tokenises just the difference — preceded by whatever the template puts after an assistant
message's content (e.g. `<|im_end|>` and a newline) that the model did not sample itself (its
end-of-turn special token, when it ended the turn with one, is already in the sequence;
a turn cut at its length limit gets the template's whole closing).

Tokenizers without a chat template get the observation text tokenised as it is (messages
joined by newlines); token-id observations are appended exactly as given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from peerflow.agents.environment import Messages, StepResult
from peerflow.errors import ConfigError

_MARK = "PEERFLOW_ASSISTANT_CONTENT"
_DUMMY: Messages = [{"role": "user", "content": "PEERFLOW_USER_CONTENT"},
                    {"role": "assistant", "content": _MARK}]


def observation_messages(result: StepResult) -> Messages:
    """The observation of `result` as chat messages (text becomes one message of `role`)."""
    if isinstance(result.observation, str):
        return [{"role": result.role, "content": result.observation}]
    return [dict(m) for m in result.observation]


def is_token_observation(observation: Any) -> bool:
    """True when an observation is token ids (a sequence of ints), not text or messages."""
    return (not isinstance(observation, str) and len(observation) > 0
            and all(isinstance(t, int) for t in observation))


@attrs.define(eq=False)
class TurnRenderer:
    """Renders observations of one tokenizer as token continuations."""

    tokenizer: Any
    _prefix: str | None = attrs.field(default=None, init=False)

    @property
    def templated(self) -> bool:
        """True when the tokenizer has a chat template."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def _render(self, messages: Messages, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def observation(self, result: StepResult, turn_ids: Sequence[int]) -> list[int]:
        """Returns the tokens to append after the model's turn `turn_ids` for `result`.

        Args:
            result: The environment's answer (text, messages or token ids).
            turn_ids: The model's turn as sampled (its last token tells whether the model
                closed the turn itself).

        Raises:
            ConfigError: the chat template does not render the dummy conversation as a
                prefix of the longer one (it cannot be continued turn by turn).
        """
        if is_token_observation(result.observation):
            return [int(t) for t in result.observation]
        messages = observation_messages(result)
        if not self.templated:
            return self._encode("\n".join(str(m.get("content", "")) for m in messages))
        if self._prefix is None:
            self._prefix = self._render(_DUMMY, generation_prompt=False)
        full = self._render(_DUMMY + messages, generation_prompt=True)
        if not full.startswith(self._prefix) or _MARK not in self._prefix:
            raise ConfigError(
                f"the chat template of {type(self.tokenizer).__name__} does not render "
                f"{[m['role'] for m in messages]} messages after an assistant turn as a "
                "continuation of the conversation before them, so observations cannot be "
                "appended without re-rendering earlier turns; return token ids from "
                "Environment.step, or use a tokenizer whose template renders turns in order."
            )
        closing = self._prefix[self._prefix.rindex(_MARK) + len(_MARK):]
        last = int(turn_ids[-1]) if len(turn_ids) else None
        if last is not None and last in set(self.tokenizer.all_special_ids):
            sampled_end = self.tokenizer.decode([last], skip_special_tokens=False)
            if sampled_end and closing.startswith(sampled_end):
                closing = closing[len(sampled_end):]
        return self._encode(closing + full[len(self._prefix):])
