"""Parity with the reference implementations: verl's `core_algos` on the same batches.

verl is installed without its dependencies (`pip install --no-deps verl`, done by
`scripts/install-cpu.sh` with the `test` extra, which carries the few modules its
`core_algos` imports: tensordict, omegaconf, codetiming, orjson); only
`verl.trainer.ppo.core_algos` and `verl.workers.config.ActorConfig` are used, on CPU.

Every case draws a random *ragged* batch (groups of several sizes, answers of several
lengths) in float64, runs PeerFlow on the flat ragged layout and verl on the padded
`[batch, max_len]` layout with a response mask, and compares values (and gradients,
for losses) to 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from peerflow.batch import Batch, RaggedField

TOLERANCE = 1e-6


@pytest.fixture(scope="session")
def verl():
    """verl's `core_algos` module (imported once; it is slow to import)."""
    import verl.trainer.ppo.core_algos as core_algos

    return core_algos


@pytest.fixture(scope="session")
def actor_config():
    """`make(clip_low, clip_high, clip_c, tokens, samples, norm)`: a verl `ActorConfig`."""
    from verl.workers.config import ActorConfig

    def make(clip_low=0.2, clip_high=0.2, clip_c=3.0, tokens=None, samples=None, norm=None):
        config = ActorConfig(strategy="fsdp", clip_ratio=clip_low, clip_ratio_low=clip_low,
                             clip_ratio_high=clip_high, clip_ratio_c=clip_c,
                             ppo_micro_batch_size_per_gpu=1, rollout_n=1)
        config.global_batch_info.update({"dp_size": 1, "batch_num_tokens": tokens,
                                         "global_batch_size": samples,
                                         "loss_scale_factor": norm})
        return config

    return make


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


@pytest.fixture(params=[0, 1, 2])
def case(request) -> RaggedCase:
    """A random ragged batch (three seeds)."""
    return RaggedCase(request.param)
