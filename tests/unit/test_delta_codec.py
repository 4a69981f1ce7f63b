"""The delta codec: changed words, encode/apply round trips, checksums (CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from peerflow.reshard.delta_codec import apply_delta, changed_words, encode_delta, region_checksum


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8])
def test_encode_then_apply_rebuilds_the_new_bytes_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    old = (torch.randn(4096, generator=g) * 50).to(dtype)
    new = old.clone()
    picked = torch.randperm(4096, generator=g)[:40]
    new[picked] = (torch.randn(40, generator=g) * 50).to(dtype)
    new[7] = float("nan") if dtype.is_floating_point else 3  # bit patterns, not values
    a, b = new.view(torch.uint8), old.view(torch.uint8)
    word = new.element_size()
    expected = torch.nonzero(
        new.view(torch.uint8).view(-1, word).ne(old.view(torch.uint8).view(-1, word)).any(1)
    ).squeeze(1)
    assert torch.equal(changed_words(a, b, word), expected)
    payload, changed, words = encode_delta(a, b, word)
    assert (changed, words) == (expected.numel(), 4096)
    assert payload is not None and payload.numel() < a.numel() / 10
    base = b.clone()
    apply_delta(base, payload, changed, word)
    assert torch.equal(base, a)


@pytest.mark.parametrize("share", [0.002, 0.05, 0.2])
def test_sparse_and_dense_changes_round_trip_as_indices_or_a_bitmap(share):
    g = torch.Generator().manual_seed(2)
    old = torch.randn(100_003, generator=g).to(torch.bfloat16)
    new = old.clone()
    picked = torch.randperm(old.numel(), generator=g)[: int(share * old.numel())]
    new[picked] = torch.randn(picked.numel(), generator=g).to(torch.bfloat16)
    a = torch.cat([new.view(torch.uint8), torch.zeros(10, dtype=torch.uint8)])  # 8-aligned
    b = torch.cat([old.view(torch.uint8), torch.zeros(10, dtype=torch.uint8)])
    payload, changed, words = encode_delta(a, b, 2)
    # indices (6 bytes a change) below 1 in 32 words changed, a bitmap (2 + 1/8) above
    per_change = payload.numel() / max(changed, 1)
    assert per_change < 6.1 if share < 1 / 32 else payload.numel() < 6 * changed
    base = b.clone()
    apply_delta(base, payload, changed, 2)
    assert torch.equal(base, a)


def test_a_dense_change_is_sent_whole():
    old = torch.zeros(256, dtype=torch.bfloat16)
    payload, changed, _ = encode_delta(
        torch.ones(256, dtype=torch.bfloat16).view(torch.uint8), old.view(torch.uint8), 2
    )
    assert payload is None and changed == 256


def test_checksum_sees_a_flipped_bit_a_moved_word_and_the_tail():
    x = torch.randint(
        0, 256, (1037,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    base = region_checksum(x)
    flip, tail, moved = x.clone(), x.clone(), x.clone()
    flip[3] ^= 1
    tail[1030] ^= 4
    moved[0:8], moved[600:608] = x[600:608].clone(), x[0:8].clone()
    for other in (flip, tail, moved):
        assert not torch.equal(region_checksum(other), base)
    assert torch.equal(region_checksum(x[1:].clone()), region_checksum(x[1:]))  # unaligned view
