"""The bytes of delta weight sync: which words changed, their encoding, and checksums.

Pure tensor functions on flat `uint8` buffers, run on the buffers' device (the GPU for a
GPU shard): `changed_words` / `encode_delta` on the sender, `apply_delta` on the
receiver, `region_checksum` on both. The protocol that uses them is
`peerflow.reshard.delta`.
"""

from __future__ import annotations

import torch

from peerflow.rounding import pad_to_multiple

#: Diff word dtypes by size in bytes.
WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Words per row of `region_checksum`'s position-weighted sum.
_ROW = 64


def region_checksum(region: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of a flat `uint8` region: its 8-byte words, and its rows weighted.

    Rows of `_ROW` words are weighted by position (a word moved to another row changes
    the sum). Integer sums wrap alike on every device and in every order, so a CPU and a
    GPU rank agree; the words are read in place (one pass, no widened copy).
    """
    if region.storage_offset() % 8:
        region = region.clone()
    whole = region.numel() // 8 * 8
    words = region[:whole].view(torch.int64)
    rows = words.numel() // _ROW * _ROW
    row_sums = words[:rows].view(-1, _ROW).sum(1)
    weights = torch.arange(1, row_sums.numel() + 1, dtype=torch.int64, device=region.device)
    tail = region[whole:].to(torch.int64)
    plain = words.sum() + tail.sum()
    weighted = (row_sums * weights).sum() + (row_sums.numel() + 1) * (
        words[rows:].sum() + tail.sum()
    )
    return torch.stack([plain, weighted])


def changed_words(new: torch.Tensor, base: torch.Tensor, word: int) -> torch.Tensor:
    """Indices of the `word`-byte words that differ (flat `uint8`, sizes a multiple of 8).

    Compares 8-byte blocks first and looks inside the changed ones only: with ~2 % of
    bf16 values changed, most blocks are equal.
    """
    blocks = torch.nonzero(new.view(torch.int64) != base.view(torch.int64)).squeeze(1)
    if word == 8:
        return blocks
    dtype, per = WORDS[word], 8 // word
    inner = new.view(dtype).view(-1, per)[blocks] != base.view(dtype).view(-1, per)[blocks]
    row, col = torch.nonzero(inner, as_tuple=True)
    return blocks[row] * per + col


def _index_dtype(words: int) -> torch.dtype:
    """The dtype of a delta's changed-word indices: int32, int64 past 2**31 words."""
    return torch.int32 if words < 2**31 else torch.int64


def _layout(changed: int, words: int) -> tuple[bool, int]:
    """Whether a delta lists its changed words as a bitmap, and the bytes before the values.

    The smaller listing wins: indices up to ~1 changed word in 32, a bitmap past it.
    """
    index_bytes = pad_to_multiple(changed * _index_dtype(words).itemsize, 16)
    bitmap_bytes = pad_to_multiple(-(-words // 8), 16)
    return (True, bitmap_bytes) if bitmap_bytes < index_bytes else (False, index_bytes)


def _bits() -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def encode_delta(
    new: torch.Tensor, base: torch.Tensor, word: int
) -> tuple[torch.Tensor | None, int, int]:
    """Changed words of `new` against `base` (flat `uint8`, same size), on their device.

    The payload lists the changed words — as int32 indices (int64 past 2**31 words), or
    as a bitmap when that is smaller (`_layout`, decided alike from the counts on both
    sides) — then their new values in order.

    Returns:
        `(payload, changed, words)`: the payload as `uint8` (`None` when it is no
        smaller than `new`); the changed words; the words compared.
    """
    dtype = WORDS[word]
    index = changed_words(new, base, word)
    changed, words = index.numel(), new.numel() // word
    bitmap, head = _layout(changed, words)
    if head + changed * word >= new.numel():
        return None, changed, words
    payload = torch.empty(head + changed * word, dtype=torch.uint8, device=new.device)
    if bitmap:
        mask = torch.zeros(head * 8, dtype=torch.bool, device=new.device)
        mask[index] = True
        bits = _bits().to(new.device)
        payload[:head].copy_((mask.view(-1, 8).to(torch.uint8) * bits).sum(1, dtype=torch.uint8))
    else:
        index_dtype = _index_dtype(words)
        payload[: changed * index_dtype.itemsize].view(index_dtype).copy_(index)
    payload[head:].view(dtype).copy_(new.view(dtype)[index])
    return payload, changed, words


def apply_delta(base: torch.Tensor, payload: torch.Tensor, changed: int, word: int) -> None:
    """Writes an `encode_delta` payload into `base` (flat `uint8`) in place."""
    dtype, words = WORDS[word], base.numel() // word
    bitmap, head = _layout(changed, words)
    values = payload[head : head + changed * word].view(dtype)
    if bitmap:
        bits = _bits().to(payload.device)
        mask = (payload[:head].unsqueeze(1) & bits).ne(0).view(-1)[:words]
        base.view(dtype)[mask] = values
        return
    index_dtype = _index_dtype(words)
    base.view(dtype)[payload[: changed * index_dtype.itemsize].view(index_dtype).long()] = values
