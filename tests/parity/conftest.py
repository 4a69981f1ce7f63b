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

from tests.parity.batches import RaggedCase


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


@pytest.fixture(params=[0, 1, 2])
def case(request) -> RaggedCase:
    """A random ragged batch (three seeds)."""
    return RaggedCase(request.param)
