"""A model directory's tokenizer, and prompts rendered with it.

Shared by single-turn rollout (`peerflow.rollout.generate`), multi-turn episodes
(`peerflow.agents`), supervised fine-tuning (`peerflow sft`) and the checks before launch
(`peerflow.launch.preflight`), and the run's fingerprint (`TOKENIZER_FILES`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peerflow.errors import ConfigError

#: The files a Hugging Face tokenizer is saved as. A model directory needs at least one;
#: the run's fingerprint hashes those present, in this order (new names go at the end, so
#: recorded fingerprints stay valid).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "vocab.txt", "merges.txt", "tokenizer.model", "added_tokens.json", "spiece.model",
)


def load_tokenizer(path: str | Path) -> Any:
    """Loads the tokenizer of a model directory.

    Raises:
        ConfigError: naming the directory, the files it has, and the fix.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds here
        present = sorted(p.name for p in Path(path).iterdir()) if Path(path).is_dir() else []
        raise ConfigError(
            f"model directory {str(path)!r}: its tokenizer does not load ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); files there: "
            f"{', '.join(present) or 'none'}. Save a complete tokenizer next to the weights: "
            f"`AutoTokenizer.from_pretrained(SOURCE).save_pretrained({str(path)!r})`."
        ) from None


def chat_template_problem(tokenizer: Any, where: str) -> list[str]:
    """Why chat prompts cannot be rendered with `tokenizer` (empty: they can).

    Args:
        tokenizer: A Hugging Face tokenizer.
        where: Names the tokenizer in the message (`model.path='…'`).
    """
    if getattr(tokenizer, "chat_template", None):
        return []
    return [f"the task's prompts are chat messages, but the tokenizer of {where} has no chat "
            "template to render them. Give the tokenizer one (`tok.chat_template = "
            "AutoTokenizer.from_pretrained(INSTRUCT_MODEL).chat_template; "
            "tok.save_pretrained(MODEL_DIR)`), use an instruct model's directory, or give "
            "text prompts (a string prompt column, and no task.options.system_prompt)."]


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, str]], *,
                  join_untemplated: bool = False) -> list[int]:
    """Returns the prompt's token ids, chat-templated when the tokenizer has a template.

    `prompt` is text (sent as one user message) or a list of `{role, content}` messages,
    rendered with `add_generation_prompt`. Without a chat template, text is tokenized as
    it is and messages are refused (`ConfigError`, naming the fix) — unless
    `join_untemplated`, for messages PeerFlow composed itself (a tool description before
    a text prompt, `peerflow.agents.tools.render_prompt`): their contents are then
    joined by newlines.

    Raises:
        ConfigError: chat messages, a tokenizer without a chat template and not
            `join_untemplated`.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if not isinstance(prompt, str) and not join_untemplated:
        where = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(chat_template_problem(tokenizer, repr(where))[0])
    text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in messages)
    return [int(i) for i in tokenizer(text, add_special_tokens=True)["input_ids"]]
