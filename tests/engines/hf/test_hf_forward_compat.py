"""The hf engine calls transformers only through APIs that are not deprecated.

transformers deprecates through `FutureWarning`s attributed to torch's `Module.__call__`
(the model's forward is called through it), so pyproject.toml's filter on warnings raised
from `peerflow.*` modules cannot see them: these tests record every warning of one
generate call and one weight load (prefill, cache reuse across samples, decode, dropping
finished rows) and fail on any deprecation.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from peerflow import GenerationRequest, ParallelLayout, SamplingParams
from peerflow.engines import EngineContext

DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def _deprecations(caught: list[warnings.WarningMessage]) -> list[str]:
    return [f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}"
            for w in caught if issubclass(w.category, DEPRECATIONS)]


@pytest.fixture(scope="module")
def engine(tiny_model):
    from peerflow.adapters.hf.engine import HFRolloutEngine

    return HFRolloutEngine(EngineContext(model_path=tiny_model, layout=ParallelLayout(), seed=3))


def test_generate_raises_no_deprecation(engine):
    tok = engine.tokenizer
    requests = [GenerationRequest(request_id=i, prompt_ids=tok(p).input_ids)
                for i, p in enumerate(["12+3=", "a much longer prompt than the first", "x"])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = engine.generate(requests, SamplingParams(n=3, temperature=1.0, max_tokens=8,
                                                           seed=1))
    assert len(results) == 9
    assert not _deprecations(caught), "\n".join(_deprecations(caught))


def test_loading_weights_raises_no_deprecation(engine):
    items = [(spec, torch.zeros(spec.local_shape)) for spec in engine.weight_targets()[:2]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_weights(items)
    assert not _deprecations(caught), "\n".join(_deprecations(caught))
