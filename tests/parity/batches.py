"""Random ragged batches for the parity tests, with their padded twins."""

from __future__ import annotations

import torch

from peerflow.batch import Batch, RaggedField

#: Largest absolute difference allowed between PeerFlow and the reference (float64).
TOLERANCE = 1e-6


class RaggedCase:
    """A random ragged batch and its padded twin."""

    def __init__(self, seed: int, group_sizes=(4, 3, 1, 5), max_len=7) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.group_id = torch.cat([torch.full((k,), g) for g, k in enumerate(group_sizes)])
        n = len(self.group_id)
        self.lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
        self.lengths[0] = max_len  # the padded width is max_len
        self.mask = torch.arange(max_len)[None, :] < self.lengths[:, None]  # [n, max_len]
        self.reward = torch.randint(0, 4, (n,), generator=gen).to(torch.float64) / 3
        self.gen = gen

    def tokens(self, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        """Random per-token values, flat (`[total_tokens]`, float64)."""
        total = int(self.lengths.sum())
        return torch.randn(total, generator=self.gen, dtype=torch.float64) * scale + shift

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """Flat per-token values as `[n, max_len]`, zeros past each length."""
        padded = flat.new_zeros(self.mask.shape)
        padded[self.mask] = flat
        return padded

    def ragged(self, flat: torch.Tensor) -> RaggedField:
        offsets = torch.zeros(len(self.lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(self.lengths, 0)
        return RaggedField(values=flat, offsets=offsets)

    def batch(self, **fields) -> Batch:
        n = len(self.lengths)
        batch = Batch(sample_id=torch.arange(n), group_id=self.group_id,
                      weight_version=torch.zeros(n, dtype=torch.int64))
        batch.set("response_ids", self.ragged(torch.zeros(int(self.lengths.sum()),
                                                          dtype=torch.int64)))
        batch.set("reward", self.reward)
        for name, flat in fields.items():
            batch.set(name, self.ragged(flat))
        return batch

    def outcome_rewards(self) -> torch.Tensor:
        """verl's `token_level_rewards`: the reward on each answer's last token."""
        rewards = torch.zeros(self.mask.shape, dtype=torch.float64)
        rewards[torch.arange(len(self.lengths)), self.lengths - 1] = self.reward
        return rewards
