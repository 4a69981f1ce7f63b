"""`plan_reshard`: property round trips against the oracle, and precise errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peerflow.conformance.harness import run_threaded
from peerflow.conformance.oracle import arange_globals, oracle_reshard, shard_all
from peerflow.errors import ShardError
from peerflow.models import RankCoords, megatron_layout, vllm_layout
from peerflow.reshard import plan_reshard
from peerflow.shard import Box, ShardPiece, ShardSpec


def cuts(draw, n):
    """A random partition of range(n) into contiguous ranges."""
    points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    edges = [0, *points, n]
    return [range(a, b) for a, b in zip(edges[:-1], edges[1:])]


@st.composite
def layouts(draw):
    """Random 1-D/2-D tensors, each split into random boxes spread over random ranks."""
    params = {f"p{i}": tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)))
              for i in range(draw(st.integers(1, 3)))}

    def side(max_ranks):
        ranks = draw(st.integers(1, max_ranks))
        out = {r: [] for r in range(ranks)}
        for name, shape in params.items():
            rows = cuts(draw, shape[0])
            cols = cuts(draw, shape[1]) if len(shape) == 2 else [None]
            for i, r_range in enumerate(rows):
                for j, c_range in enumerate(cols):
                    offsets = (r_range.start,) + ((c_range.start,) if c_range else ())
                    sizes = (len(r_range),) + ((len(c_range),) if c_range else ())
                    rank = draw(st.integers(0, ranks - 1))
                    out[rank].append(ShardSpec.of_slice(
                        name, shape, Box(offsets=offsets, sizes=sizes),
                        local_name=f"{name}.{i}.{j}"))
        return out

    return params, side(3), side(3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.sampled_from([16, 64, 1 << 20]))
def test_random_reshards_match_the_oracle_and_round_trip(case, bucket_bytes):
    params, src, dst = case
    full = arange_globals(params)
    src_tensors = shard_all(src, full)
    plan = plan_reshard(src, dst)
    got, _ = run_threaded(plan, src_tensors, bucket_bytes=bucket_bytes)
    want = oracle_reshard(src, src_tensors, dst)
    for rank, tensors in want.items():
        for name, tensor in tensors.items():
            assert torch.equal(got[rank][name], tensor), (rank, name)
    back, _ = run_threaded(plan_reshard(dst, src), got, bucket_bytes=bucket_bytes)
    for rank, tensors in src_tensors.items():
        for name, tensor in tensors.items():
            assert torch.equal(back[rank][name], tensor), (rank, name)


@given(layouts())
@settings(max_examples=40, deadline=None)
def test_every_destination_element_is_written_exactly_once(case):
    params, src, dst = case
    plan = plan_reshard(src, dst)
    for rank, specs in dst.items():
        for spec in specs:
            count = torch.zeros(spec.local_shape, dtype=torch.int32)
            for t in plan.transfers:
                if t.dst_rank == rank and t.dst_tensor == spec.local_name:
                    count[t.dst_box.slices()] += 1
            assert bool((count == 1).all())


def spec(name, shape, offsets, sizes, *, local=None, replica=0):
    return ShardSpec.of_slice(name, shape, Box(offsets=offsets, sizes=sizes),
                              local_name=local or name, replica=replica)


def test_overlapping_sources_name_parameter_and_region():
    src = {0: [spec("w", (4, 4), (0, 0), (3, 4))], 1: [spec("w", (4, 4), (2, 0), (2, 4))]}
    with pytest.raises(ShardError, match=r"w: region \[2:3, 0:4\] is held by two replica-0"):
        plan_reshard(src, [spec("w", (4, 4), (0, 0), (4, 4))])


def test_replicas_do_not_count_as_overlap():
    src = {0: [spec("w", (4,), (0,), (4,))], 1: [spec("w", (4,), (0,), (4,), replica=1)]}
    plan = plan_reshard(src, {2: [spec("w", (4,), (0,), (4,))]})
    assert {t.src_rank for t in plan.transfers} == {0}


def test_uncovered_destination_names_parameter_and_region():
    src = [spec("w", (4, 4), (0, 0), (4, 2))]
    with pytest.raises(ShardError, match=r"w: region \[0:4, 2:4\] needed by destination rank 0"):
        plan_reshard(src, [spec("w", (4, 4), (0, 0), (4, 4))])


def test_unused_source_is_an_error_unless_ignored():
    src = [spec("w", (4,), (0,), (4,)), spec("head", (2,), (0,), (2,))]
    dst = [spec("w", (4,), (0,), (2,))]
    with pytest.raises(ShardError, match=r"head: region \[0:2\] of source rank 0 .* ignore="):
        plan_reshard(src, dst)
    with pytest.raises(ShardError, match=r"w: region \[2:4\] of source rank 0 .* is read by no"):
        plan_reshard(src, dst, ignore=["head"])
    plan = plan_reshard(src, dst, ignore=["w", "he*"])
    assert len(plan.transfers) == 1


def test_shape_disagreement_and_double_written_destination():
    with pytest.raises(ShardError, match=r"w: .* global shape is \(4,\), but .* says \(5,\)"):
        plan_reshard([spec("w", (5,), (0,), (5,))], [spec("w", (4,), (0,), (4,))])
    twice = ShardSpec(local_name="fused", local_shape=(4,), pieces=(
        ShardPiece(name="w", global_shape=(4,), global_box=Box(offsets=(0,), sizes=(3,)),
                   local_box=Box(offsets=(0,), sizes=(3,))),
        ShardPiece(name="w", global_shape=(4,), global_box=Box(offsets=(1,), sizes=(3,)),
                   local_box=Box(offsets=(1,), sizes=(3,)))))
    with pytest.raises(ShardError, match=r"tensor 'fused': local region \[1:3\] is written twice"):
        plan_reshard([spec("w", (4,), (0,), (4,))], [twice])
    hole = ShardSpec(local_name="h", local_shape=(4,), pieces=(
        ShardPiece(name="w", global_shape=(4,), global_box=Box(offsets=(0,), sizes=(3,)),
                   local_box=Box(offsets=(0,), sizes=(3,))),))
    with pytest.raises(ShardError, match=r"tensor 'h': local region \[3:4\]"):
        plan_reshard([spec("w", (4,), (0,), (4,))], [hole])


def test_megatron_tp2_to_vllm_tp4_matches_oracle():
    config = dict(model_type="qwen2", vocab_size=70, hidden_size=16, intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=4)
    src = {r: megatron_layout(config, RankCoords(tp_rank=r, tp_size=2)) for r in range(2)}
    dst = {2 + r: vllm_layout(config, RankCoords(tp_rank=r, tp_size=4)) for r in range(4)}
    from peerflow.models import hf_parameters
    full = arange_globals(hf_parameters(config))
    tensors = shard_all(src, full)
    plan = plan_reshard(src, dst)
    got, stats = run_threaded(plan, tensors, bucket_bytes=4096)
    want = shard_all(dst, full)
    for rank in dst:
        for name, tensor in want[rank].items():
            assert torch.equal(got[rank][name], tensor), name
    assert sum(s.buckets for s in stats.values()) > len(stats)  # several buckets each
