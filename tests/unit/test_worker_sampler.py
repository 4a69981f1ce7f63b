from __future__ import annotations

import pytest

from peerflow.algorithms.base import Example
from peerflow.errors import ConfigError
from peerflow.rollout.sampler import ShardedPromptSampler, split_evenly


def finite(n):
    return lambda: iter(Example(prompt=str(i), index=i) for i in range(n))


def endless():
    def gen():
        i = 0
        while True:
            yield Example(prompt=str(i), index=i)
            i += 1
    return gen


def test_ranks_read_disjoint_shards_covering_each_epoch():
    data = [Example(prompt=str(i), index=i) for i in range(10)]
    samplers = [ShardedPromptSampler(examples=lambda: iter(data), dp_rank=r, dp_size=2, seed=3,
                                     size=10, lookup=data.__getitem__) for r in range(2)]
    draws = [s.draw(5) for s in samplers]
    positions = sorted(d.position for ds in draws for d in ds)
    assert positions == list(range(10))
    indices = sorted(d.example.index for ds in draws for d in ds)
    assert indices == list(range(10))  # one epoch: every example exactly once
    # the epoch is shuffled, not the file order
    assert [d.example.index for d in draws[0]] != [0, 2, 4, 6, 8]


def test_next_epoch_uses_a_new_permutation():
    s = ShardedPromptSampler(examples=finite(6), dp_rank=0, dp_size=1, seed=0)
    first = [d.example.index for d in s.draw(6)]
    second = [d.example.index for d in s.draw(6)]
    assert sorted(first) == sorted(second) == list(range(6))
    assert first != second


def test_resume_replays_the_same_prompts():
    a = ShardedPromptSampler(examples=endless(), dp_rank=1, dp_size=3, seed=0)
    a.draw(4)
    state = a.state_dict()
    rest = [d.position for d in a.draw(5)]
    b = ShardedPromptSampler(examples=endless(), dp_rank=1, dp_size=3, seed=0)
    b.load_state_dict(state)
    assert [d.position for d in b.draw(5)] == rest
    assert rest == [13, 16, 19, 22, 25]


def test_scanned_dataset_keeps_order_then_reshuffles():
    scan = ShardedPromptSampler(examples=finite(7), dp_rank=0, dp_size=1, seed=5)
    assert [d.example.index for d in scan.draw(7)] == list(range(7))  # task order
    second = [d.example.index for d in scan.draw(7)]
    assert sorted(second) == list(range(7)) and second != list(range(7))


def test_resume_with_other_dp_size_is_refused():
    a = ShardedPromptSampler(examples=endless(), dp_rank=0, dp_size=2)
    b = ShardedPromptSampler(examples=endless(), dp_rank=0, dp_size=4)
    with pytest.raises(ConfigError, match="same nprocs"):
        b.load_state_dict(a.state_dict())


def test_empty_dataset_is_a_clear_error():
    s = ShardedPromptSampler(examples=finite(0), dp_rank=0, dp_size=1)
    with pytest.raises(ConfigError, match="no training examples"):
        s.draw(1)


def test_split_evenly():
    assert [split_evenly(10, 3, i) for i in range(3)] == [4, 3, 3]
    assert sum(split_evenly(32, 2, i) for i in range(2)) == 32
