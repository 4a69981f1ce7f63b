"""A character-level tokenizer trained in-process, wrapped for Hugging Face.

`tokenizers` trains a BPE model over a byte-level pre-tokenizer; with the vocabulary
capped at the alphabet plus special tokens no merges happen, so every character is one
token (what a tiny model learns fastest). The result is a `PreTrainedTokenizerFast` with
a minimal chat template (BOS, then the message contents), saved with `save_pretrained`
and loadable with `AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)

#: BOS, then every message's content; the generation prompt adds nothing, so the model
#: continues right after the prompt text (tasks end their prompts with a marker).
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


def train_char_tokenizer(corpus: Iterable[str], extra_merges: int = 0) -> Any:
    """Trains a tokenizer whose vocabulary is every character of `corpus`.

    Args:
        corpus: Text the tokenizer must cover (every character becomes a token).
        extra_merges: BPE merges on top of the characters (0: purely character-level).

    Returns:
        A `transformers.PreTrainedTokenizerFast` with BOS/EOS/PAD/UNK and a chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(corpus)
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = sorted({
        char for text in texts for piece, _ in pre_tokenizer.pre_tokenize_str(text)
        for char in piece
    })
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(alphabet) + extra_merges,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet, show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        unk_token=UNK,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
