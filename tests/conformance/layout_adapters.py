"""Layout-only adapter classes for exercising the suite's layers 1–2 in this repository.

They declare shards with `peerflow.models` builders exactly as a real vLLM-, Megatron- or
FSDP-style adapter would; nothing instantiates them (layers 1–2 only call
`shard_layout`). `BrokenVocabPadding` is deliberately wrong.
"""

from __future__ import annotations

import attrs

from peerflow.capabilities import Capabilities
from peerflow.engines import RolloutEngine, TrainEngine
from peerflow.layout import ParallelLayout
from peerflow.models import RankCoords, hf_layout, megatron_layout, tp_layout, vllm_layout
from peerflow.shard import Box, ShardPiece, ShardSpec

PARALLEL = Capabilities(tensor_parallel=True, pipeline_parallel=True)


def _rank_layout(builder):
    """`shard_layout` of an adapter whose rank holds `builder`'s layout at its coordinates."""
    return staticmethod(lambda hf_config, layout, rank: builder(hf_config,
                                                                RankCoords.of(layout, rank)))


class VllmStyleLayouts(RolloutEngine):
    name = "test-vllm-layouts"
    capabilities = PARALLEL
    shard_layout = _rank_layout(vllm_layout)


class VllmStyleExpertLayouts(RolloutEngine):
    """vLLM's FusedMoE layout (`w13`/`w2`) with experts split over `ep` ranks.

    Each ep rank holds a contiguous block of experts (whole experts); attention, norms,
    router and embeddings are held by every ep rank, so ep peers count as replicas of
    them (the replica index folds ep into dp). With tp, each expert's width is split
    only without ep (vLLM's default expert tp).
    """

    name = "test-vllm-expert-layouts"
    capabilities = Capabilities(tensor_parallel=True, expert_parallel=True)

    @classmethod
    def shard_layout(cls, hf_config, layout, rank):
        c = layout.coord(rank)
        return vllm_layout(hf_config, RankCoords(
            tp_rank=c.tp, tp_size=layout.tp, ep_rank=c.ep, ep_size=layout.ep,
            dp_rank=c.dp * layout.ep + c.ep,
            expert_replica=c.dp if layout.ep > 1 else None))

    @classmethod
    def conformance_layouts(cls):
        return [ParallelLayout(), ParallelLayout(ep=2), ParallelLayout(ep=4),
                ParallelLayout(tp=2), ParallelLayout(dp=2, ep=2)]

    @classmethod
    def conformance_families(cls):
        return ("qwen3_moe", "mixtral")


class MegatronStyleLayouts(TrainEngine):
    name = "test-megatron-layouts"
    capabilities = PARALLEL
    shard_layout = _rank_layout(megatron_layout)


class FsdpStyleLayouts(TrainEngine):
    name = "test-fsdp-layouts"
    capabilities = Capabilities(tensor_parallel=True)

    @classmethod
    def shard_layout(cls, hf_config, layout, rank):
        if layout.tp > 1:
            return tp_layout(hf_config, RankCoords.of(layout, rank))
        return hf_layout(hf_config, shard_rank=layout.coord(rank).dp, shard_size=layout.dp)


def _evolve(spec: ShardSpec, **changes) -> ShardSpec:
    return attrs.evolve(spec, **changes)


class BrokenVocabPadding(VllmStyleLayouts):
    """Pads the vocabulary one row too early: the last real token row becomes padding."""

    name = "test-broken-vocab"

    @classmethod
    def shard_layout(cls, hf_config, layout, rank):
        out = []
        for spec in super().shard_layout(hf_config, layout, rank):
            if spec.local_name in ("model.embed_tokens.weight", "lm_head.weight") and \
                    spec.padding and spec.pieces:
                (piece,) = spec.pieces
                rows = piece.global_box.sizes[0] - 1
                cols = piece.global_box.sizes[1]
                shrunk = ShardPiece(
                    name=piece.name, global_shape=piece.global_shape,
                    global_box=Box(offsets=piece.global_box.offsets, sizes=(rows, cols)),
                    local_box=Box(offsets=piece.local_box.offsets, sizes=(rows, cols)))
                pad = spec.padding[0]
                spec = _evolve(spec, pieces=(shrunk,), padding=(Box(
                    offsets=(pad.offsets[0] - 1, 0), sizes=(pad.sizes[0] + 1, cols)),))
            out.append(spec)
        return out


class VocabPaddingWithXfails(BrokenVocabPadding):
    """Declares one real failure and one test that in fact passes as expected failures."""

    name = "test-xfail-declarations"

    @classmethod
    def conformance_xfail(cls):
        return {"test_l1_shards_cover_the_model": "vocab padding is off by one (known)",
                "test_l1_layout_is_deterministic": "declared by mistake: this test passes"}
