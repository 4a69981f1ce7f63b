"""A tiny random Qwen2 model whose tokenizer has a Qwen2.5-style tool-calling template."""

from __future__ import annotations

import string
from pathlib import Path

#: Written for these tests in the shape of Qwen2.5's template: tools in the system turn,
#: consecutive `tool` messages inside one user turn as <tool_response> blocks.
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful \
assistant.{% endif %}{{ '\n\n' }}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

SPECIAL = ["<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_chat_tokenizer(directory: Path | None = None):
    """A character-level tokenizer over printable ASCII with ChatML special tokens."""
    from tokenizers import AddedToken

    from peerflow.contrib.tasks.tokenizer import train_char_tokenizer

    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.add_tokens([AddedToken(t, special=False) for t in ADDED])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    if directory is not None:
        tokenizer.save_pretrained(directory)
    return tokenizer


def build_chat_model(directory: Path) -> str:
    """Saves a tiny random Qwen2 model with that tokenizer under `directory`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_chat_tokenizer(directory)
    config = AutoConfig.for_model(
        "qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)


def build_chatml_llama(directory: Path, chat_template: str, max_positions: int | None = None,
                       ) -> str:
    """The engine tests' tiny Llama with `<|im_start|>`/`<|im_end|>` added and a template.

    Args:
        directory: Where it is saved.
        chat_template: The tokenizer's chat template.
        max_positions: A larger `max_position_embeddings` (room for long prompts).
    """
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.engines.hf.tiny_models import build_tiny_model

    path = build_tiny_model(directory)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = chat_template
    model = AutoModelForCausalLM.from_pretrained(path)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    if max_positions is not None:
        config = Path(path) / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()),
                                      "max_position_embeddings": max_positions}))
    return path
