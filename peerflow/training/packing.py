"""Padding-free micro-batches: a micro-batch's samples concatenated into one row.

A right-padded micro-batch computes `rows * longest` positions; on long-tailed answers a
third of them can be padding. Padding-free, the samples of a micro-batch follow each
other in one row `[1, T]`, `T` their real tokens, with position ids that restart at 0
for every sample, and the attention implementation keeps each sample to itself:
transformers builds a block-diagonal causal mask from such position ids for `sdpa`,
`eager` and `flex_attention` (`masking_utils.find_packed_sequence_indices`) and calls
flash-attention's variable-length kernels for `flash_attention_*` (as verl, OpenRLHF
and prime-rl train). Log-probs, entropy and values are read per token at the positions
that predict each response token, as for the shared-prompt layout, whose class
(`SharedPromptInputs`) these inputs are.

Shared prompts (`shares_prompts`) stay shared: a prompt's samples form one segment
`[prompt, answer_1, …]` of the row; position ids restart after the prompt for every
answer, which position ids alone cannot express, so those rows carry the explicit mask
of `peerflow.training.shared_prompts` (segments and answers kept apart).

What it costs depends on the attention implementation. Flash-attention's varlen kernels
and flex attention's block mask compute each sample's own `L_i²` scores; `sdpa` and
`eager` apply a dense `T × T` mask to the whole row, so a micro-batch of many samples
pays `T²` attention where the padded layout pays `rows × L²` (on the realistic bench
model on the CPU, a 4,300-token row of four samples took about twice the padded step's
time). Hence `trainer.padding_free`: `auto` turns it on where attention follows the
samples (`VARLEN_ATTENTION`), `true` also under `sdpa`/`eager` (exact, dense), `false`
keeps padded micro-batches; the rank log says which. Padding-free micro-batches are
planned by real tokens (`microbatch.pack_real_tokens`).
"""

from __future__ import annotations

import torch

from peerflow.batch import Batch
from peerflow.distributed.ranklog import say_in_rank_log
from peerflow.errors import ConfigError
from peerflow.training.shared_prompts import (
    SharedPromptInputs,
    prompt_tuples,
    segment_inputs,
    shared_prompt_groups,
)

#: transformers attention implementations that keep packed samples apart from their
#: position ids at the cost of each sample's own scores (varlen kernels, a block mask).
VARLEN_ATTENTION = frozenset({"flash_attention_2", "flash_attention_3", "flex_attention"})
#: Those that keep them apart through a dense block-diagonal `T × T` mask.
DENSE_PACKING_ATTENTION = frozenset({"sdpa", "eager"})

#: Values of `trainer.padding_free`.
SETTINGS = ("auto", True, False)


def attention_backend(model: torch.nn.Module) -> str | None:
    """The transformers attention implementation `model` was loaded with (or `None`)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def transformers_packs() -> bool:
    """Whether the installed transformers detects packed samples from position ids."""
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_padding_free(setting: bool | str, model: torch.nn.Module, engine: str) -> bool:
    """`trainer.padding_free` for `model`: whether micro-batches go padding-free.

    Logs the decision (the rank log says which layout the trainer runs).

    Raises:
        ConfigError: `setting` is not auto/true/false, or `true` under an attention
            implementation that would let packed samples see each other.
    """
    if setting not in SETTINGS:
        raise ConfigError(f"trainer.padding_free={setting!r}: expected auto, true or false.")
    backend = attention_backend(model)
    varlen = backend in VARLEN_ATTENTION or "flash" in str(backend)
    supported = (varlen or backend in DENSE_PACKING_ATTENTION) and transformers_packs()
    if setting is True and not supported:
        raise ConfigError(
            f"trainer.padding_free=true but {engine}'s model runs attention {backend!r}, "
            f"which does not keep packed samples apart (supported: "
            f"{sorted(VARLEN_ATTENTION | DENSE_PACKING_ATTENTION)} with transformers >= "
            "4.53); set trainer.padding_free: auto (or false), or load the model with one "
            "of those (attn_implementation).")
    on = supported and (setting is True or (setting == "auto" and varlen))
    why = "" if on or not supported or setting is False else \
        " — its dense T x T mask costs more than padding; true forces it"
    say_in_rank_log(f"{engine}: padding-free micro-batches {'on' if on else 'off'} "
        f"(trainer.padding_free={str(setting).lower()}, attention {backend!r}{why}).")
    return on


def packed_inputs(batch: Batch, *, share_prompts: bool) -> SharedPromptInputs:
    """Lays out `batch` padding-free: every sample (or shared-prompt group) in one row.

    With `share_prompts` a prompt's samples share one copy of it (an explicit mask keeps
    them apart); without, each sample is its own segment and no mask is passed.

    Raises:
        ValueError: A sample has no prompt token (nothing predicts its first token).
    """
    if not len(batch):
        return segment_inputs(batch, [], masked=share_prompts)
    if share_prompts:
        segments = shared_prompt_groups(prompt_tuples(batch))
    else:
        segments = [[i] for i in range(len(batch))]
    return segment_inputs(batch, [segments], masked=share_prompts)
