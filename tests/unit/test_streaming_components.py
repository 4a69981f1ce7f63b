"""Versions, token balancing, samplers and the micro-batch accumulator."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerflow.errors import DuplicateNameError, UnknownNameError
from peerflow.plugins import get_plugin_manager
from peerflow.streaming.accumulator import MicroBatchAccumulator, StepInbox
from peerflow.streaming.assignment import TokenBalancer
from peerflow.streaming.samplers import MicroBatchBudget, PooledSample, Sampler
from peerflow.streaming.versions import (
    append_segment,
    check_segments,
    oldest_version,
    segments_from_token_versions,
    token_versions,
)
from tests.helpers.batches import group_batch
from tests.helpers.plugins import registering


def get_sampler(name):
    return get_plugin_manager().get("sampler", name)()


# --- versions -----------------------------------------------------------------------


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # loaded CI machines
@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.integers(0, 3))
def test_segments_round_trip(run_lengths, first_version):
    segments, start = (), 0
    for k, length in enumerate(run_lengths):
        segments = append_segment(segments, start, first_version + k)
        start += length
    per_token = token_versions(segments, start, default=-1)
    assert segments_from_token_versions(per_token) == segments
    assert oldest_version(segments, default=99) == first_version
    assert per_token.tolist() == [
        first_version + k for k, length in enumerate(run_lengths) for _ in range(length)
    ]


def test_segments_validation_and_defaults():
    assert token_versions((), 3, default=4).tolist() == [4, 4, 4]
    assert append_segment(((0, 1),), 5, 1) == ((0, 1),)
    with pytest.raises(ValueError, match="start at token 0"):
        check_segments(((1, 0),), 4)
    with pytest.raises(ValueError, match="must not decrease"):
        check_segments(((0, 2), (2, 1)), 4)
    with pytest.raises(ValueError, match="past the last"):
        check_segments(((0, 0), (9, 1)), 4)


# --- token balancing -----------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(1, 500), min_size=1, max_size=40), st.integers(0, 4))
def test_balancer_keeps_trainers_within_one_group(consumers, tokens, source):
    balancer = TokenBalancer(num_consumers=consumers, source_index=source)
    for t in tokens:
        balancer.assign(step=0, tokens=t)
    counts = balancer.tokens[0]
    assert sum(counts) == sum(tokens)
    if len(tokens) >= consumers:
        assert all(g > 0 for g in balancer.groups[0])  # every trainer gets work
    assert max(counts) - min(counts) <= max(tokens)
    clone = TokenBalancer.from_state_dict(balancer.state_dict())
    assert clone.assign(0, 5) == balancer.assign(0, 5)


def test_balancer_rotates_ties_by_source():
    assert TokenBalancer(num_consumers=3, source_index=0).assign(0, 10) == 0
    assert TokenBalancer(num_consumers=3, source_index=2).assign(0, 10) == 2


# --- samplers ------------------------------------------------------------------------


def pool_of(tokens, group_size=2):
    return [
        PooledSample(sample_id=i, group_id=i // group_size, tokens=t) for i, t in enumerate(tokens)
    ]


def test_sequential_waits_until_full():
    sampler = get_sampler("sequential")
    budget = MicroBatchBudget(max_tokens=10)
    assert sampler.select(pool_of([3, 3]), budget, final=False) == []
    assert sampler.select(pool_of([3, 3, 5]), budget, final=False) == [0, 1]
    assert sampler.select(pool_of([3, 3]), budget, final=True) == [0, 1]
    assert sampler.select(pool_of([30, 1]), budget, final=False) == [0]  # oversize alone


def test_grouped_never_splits_a_group():
    sampler = get_sampler("grouped")
    budget = MicroBatchBudget(max_tokens=10)
    # groups: {0,1}=8 tokens, {2,3}=8 tokens -> first group alone
    assert sampler.select(pool_of([4, 4, 4, 4]), budget, final=False) == [0, 1]
    assert get_sampler("sequential").select(pool_of([4, 4, 4, 4]), budget, False) == [0, 1]
    assert sampler.select(pool_of([2, 2, 3, 3]), budget, final=False) == []


def test_length_balanced_packs_first_fit_decreasing():
    sampler = get_sampler("length_balanced")
    budget = MicroBatchBudget(max_tokens=10)
    assert sampler.select(pool_of([2, 6, 3, 4]), budget, final=False) == [1, 3]
    assert sampler.select(pool_of([2, 3]), budget, final=False) == []
    assert sampler.select(pool_of([2, 3]), budget, final=True) == [0, 1]


def test_sample_count_budget():
    budget = MicroBatchBudget(max_tokens=1000, max_samples=2)
    for name in ("sequential", "length_balanced"):
        assert get_sampler(name).select(pool_of([1, 1, 1]), budget, final=False) == [0, 1]


def test_sampler_registry_errors(plugin_manager):
    with pytest.raises(UnknownNameError, match="Did you mean 'grouped'"):
        plugin_manager.get("sampler", "groupd")

    class Another(Sampler):
        name = "sequential"

        def select(self, pool, budget, final):
            return []

    class Reverse(Sampler):
        name = "test_reverse"

        def select(self, pool, budget, final):
            return list(range(len(pool)))[::-1] if final else []

    plugin_manager.register(registering("peerflow_register_samplers", Reverse), "test-samplers")
    assert isinstance(plugin_manager.get("sampler", "test_reverse")(), Reverse)

    plugin_manager.register(registering("peerflow_register_samplers", Another), "test-clash")
    with pytest.raises(DuplicateNameError, match="sequential"):
        plugin_manager.registry("sampler")


# --- accumulator ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["sequential", "grouped", "length_balanced"]),
    st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=4), min_size=1, max_size=12),
    st.integers(5, 80),
)
def test_accumulator_emits_every_sample_exactly_once(sampler, groups, budget_tokens):
    acc = MicroBatchAccumulator(
        sampler=get_sampler(sampler), budget=MicroBatchBudget(max_tokens=budget_tokens)
    )
    emitted, sid = [], 0
    for gid, lengths in enumerate(groups):
        acc.add(group_batch(gid, lengths, sid))
        sid += len(lengths)
        for mb in acc.pop_ready():
            emitted.append(mb)
    emitted += acc.pop_ready(final=True)
    ids = [int(s) for mb in emitted for s in mb.sample_id]
    assert sorted(ids) == list(range(sid))
    assert acc.pending == 0
    for mb in emitted:
        # only a single oversize unit (a sample, or a group for `grouped`) may exceed it
        units = len(set(mb.group_id.tolist())) if sampler == "grouped" else len(mb)
        if units > 1:
            assert int(mb.token_count().sum()) <= budget_tokens
    if sampler == "grouped":
        for mb in emitted:
            for g in set(mb.group_id.tolist()):
                assert int((mb.group_id == g).sum()) == len(groups[g])


def test_accumulator_refuses_a_sample_twice():
    acc = MicroBatchAccumulator(sampler=get_sampler("sequential"),
                                budget=MicroBatchBudget(max_tokens=1000, max_samples=2))
    acc.add(group_batch(0, [3, 4], first_sid=0))
    (mb,) = acc.pop_ready()
    assert mb.sample_id.tolist() == [0, 1]
    with pytest.raises(ValueError, match="twice"):
        acc.add(group_batch(0, [3], first_sid=1))


def test_accumulator_final_names_missing_fields():
    acc = MicroBatchAccumulator(
        sampler=get_sampler("sequential"),
        budget=MicroBatchBudget(max_tokens=100),
        required_fields=("reward",),
    )
    acc.add(group_batch(0, [3], first_sid=0))
    with pytest.raises(ValueError, match="reward"):
        acc.pop_ready(final=True)


def test_step_inbox_counts_out_of_order_seals():
    inbox = StepInbox(sources=(0, 1))
    inbox.on_seal(0, 0, count=2)
    inbox.on_group(0, 0)
    inbox.on_seal(0, 1, count=0)
    assert not inbox.complete(0)
    inbox.on_group(0, 0)
    assert inbox.complete(0)
    assert not inbox.complete(1)
    inbox.forget(0)
    assert not inbox.complete(0)


# --- async config checks -------------------------------------------------------------


def test_async_config_errors_name_the_fix():
    import attrs

    from peerflow.config import RunConfig
    from peerflow.errors import ConfigError
    from peerflow.layout import ParallelLayout
    from peerflow.planner.streaming import check_async_config

    config = RunConfig()
    layouts = {"rollout": ParallelLayout(ranks=(0,)), "actor": ParallelLayout(ranks=(1,))}
    runtime = attrs.evolve(config.runtime, mode="async")
    with pytest.raises(ConfigError, match="placement: split"):
        check_async_config(attrs.evolve(config, runtime=runtime), layouts)
    split = attrs.evolve(config, runtime=attrs.evolve(runtime, placement="split"))
    check_async_config(split, layouts)
    with pytest.raises(ConfigError, match="tp=pp=1"):
        check_async_config(split, {**layouts, "rollout": ParallelLayout(tp=2, ranks=(0, 1))})
    with pytest.raises(UnknownNameError, match="sampler"):
        check_async_config(
            attrs.evolve(split, runtime=attrs.evolve(split.runtime, sampler="nope")), layouts,
            get_plugin_manager())
