"""Partial rollout with the real HF reference engine: segments keep their versions."""

from __future__ import annotations

import pytest
import torch

from peerflow.batch import Batch, RaggedField
from peerflow.engines import EngineContext, GenerationRequest, SamplingParams
from peerflow.layout import ParallelLayout
from peerflow.streaming.metrics import clip, merge_intervals, overlap_fraction, staleness_metrics
from peerflow.streaming.partial import generate_in_segments
from peerflow.streaming.rollout_loop import attach_segments, split_groups
from peerflow.streaming.versions import TOKEN_VERSIONS


@pytest.fixture(scope="module")
def hf_engine():
    pytest.importorskip("transformers")
    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.contrib.tasks.generated import ReverseDigitsTask

    path = ReverseDigitsTask.build_model(
        {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2,
         "num_kv_heads": 2}
    )
    engine = HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout()))
    yield engine
    engine.shutdown()


def _bump_weights(engine, version):
    """Publishes new weights (every tensor scaled) as `version` through the contract."""
    engine.begin_weight_update(version)
    items = []
    for spec in engine.weight_targets():
        tensor = engine._params[spec.local_name].detach().clone()
        items.append((spec, tensor * 1.5))
    engine.load_weights(items)
    engine.finish_weight_update()


def test_segments_record_the_version_of_every_token(hf_engine):
    version0 = hf_engine.weight_version
    changes = []

    def between():
        changes.append(hf_engine.weight_version + 1)
        _bump_weights(hf_engine, hf_engine.weight_version + 1)

    sampling = SamplingParams(n=3, temperature=1.0, max_tokens=7, seed=5, stop_token_ids=())
    requests = [GenerationRequest(request_id=10 + i, prompt_ids=(3, 4, 5, 6)) for i in range(2)]
    results = generate_in_segments(hf_engine, requests, sampling, chunk_tokens=2,
                                   between_chunks=between)
    assert [(r.request_id, r.index) for r in results] == [(10, 0), (10, 1), (10, 2),
                                                          (11, 0), (11, 1), (11, 2)]
    assert changes, "no answer outlived its first chunk"
    for r in results:
        assert len(r.logprobs) == len(r.token_ids) <= 7
        assert r.version_segments[0] == (0, version0)
        starts = [s for s, _ in r.version_segments]
        versions = [v for _, v in r.version_segments]
        assert starts == sorted(starts) and versions == sorted(versions)
        # a new segment can only begin at a chunk boundary
        assert all(s % 2 == 0 for s in starts)
        if len(r.token_ids) > 2:
            assert len(r.version_segments) >= 2
    # packed into a batch, the oldest segment is the sample's version
    batch = Batch(
        sample_id=torch.arange(len(results)),
        group_id=torch.tensor([r.request_id for r in results]),
        weight_version=torch.full((len(results),), hf_engine.weight_version),
        fields={"response_ids": RaggedField.from_tensors(
            [torch.tensor(r.token_ids, dtype=torch.int64) for r in results])},
    )
    attach_segments(batch, [r.version_segments for r in results])
    assert batch.weight_version.tolist() == [version0] * len(results)
    per_token = batch.ragged(TOKEN_VERSIONS)
    for i, r in enumerate(results):
        row = per_token.row(i).tolist()
        assert len(row) == len(r.token_ids)
        for start, version in r.version_segments:
            assert row[start] == version
    assert [len(g) for g in split_groups(batch)] == [3, 3]


def test_segments_need_a_positive_chunk(hf_engine):
    with pytest.raises(ValueError, match="chunk_tokens"):
        generate_in_segments(hf_engine, [], SamplingParams(), chunk_tokens=0)


def test_activity_metrics():
    assert merge_intervals([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert clip([(0, 10)], (2, 3)) == [(2, 3)]
    assert overlap_fraction([(0, 10)], [(5, 20)]) == 0.5
    assert overlap_fraction([(0, 2), (4, 6)], [(1, 5)]) == 0.5
    assert overlap_fraction([], [(0, 1)]) == 0.0
    m = staleness_metrics([0, 1, 1, 0], bound=2)
    assert m["staleness/max"] == 1 and m["staleness/mean"] == 0.5
    assert (m["staleness/hist_0"], m["staleness/hist_1"], m["staleness/hist_2"]) == (0.5, 0.5, 0)
    assert staleness_metrics([]) == {}
