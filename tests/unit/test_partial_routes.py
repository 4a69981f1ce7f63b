"""Partial rollout keeps an MoE answer's routes whole across chunks."""

from __future__ import annotations

import torch

from peerflow import GenerationRequest, ParallelLayout, SamplingParams
from peerflow.engines import EngineContext
from peerflow.streaming.partial import generate_in_segments


def test_chunked_answers_carry_one_route_per_token(tmp_path):
    from transformers import AutoModelForCausalLM

    from peerflow.adapters.hf.engine import HFRolloutEngine
    from peerflow.training.routing_replay import RoutingReplay
    from tests.engines.hf.tiny_models import build_tiny_model

    path = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_experts=4, top_k=2)
    engine = HFRolloutEngine(EngineContext(model_path=path, layout=ParallelLayout()))
    requests = [GenerationRequest(request_id=i, prompt_ids=engine.tokenizer(p).input_ids)
                for i, p in enumerate(["12+3=", "hello"])]
    results = generate_in_segments(engine, requests, SamplingParams(n=2, max_tokens=9, seed=1),
                                   chunk_tokens=3)
    assert any(len(r.token_ids) > 6 for r in results)  # answers spanning three chunks
    reference = AutoModelForCausalLM.from_pretrained(path)
    replay = RoutingReplay.attach(reference, "off")
    for result in results:
        ids = list(requests[result.request_id].prompt_ids) + list(result.token_ids)
        routes = result.routed_experts
        assert routes is not None and len(routes) == len(ids)
        assert bool((routes[-1] == -1).all()) and bool((routes[:-1] >= 0).all())
        with replay.forcing(None, record=True):  # the same weights, teacher-forced
            reference(input_ids=torch.tensor([ids]), use_cache=False)
            expected = replay.recorded()[:-1]
        same = (routes[:-1].sort(-1).values == expected.sort(-1).values).all(-1)
        assert float(same.float().mean()) > 0.95
