"""Shared test settings: offline hub, loopback gloo, one torch thread, fresh plugins."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def plugin_manager():
    """A freshly loaded plugin manager, discarded after the test."""
    from peerflow.plugins.manager import get_plugin_manager, reset_plugin_manager

    reset_plugin_manager()
    yield get_plugin_manager()
    reset_plugin_manager()


# Tiny models the engine tests share, built once per session. They live here rather than in
# a tests/engines/conftest.py: pytest would put tests/engines on sys.path for that file,
# and its sub-folders (sglang/, vllm/, …) would then look like installed engine packages.
@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tests.engines.hf.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_untied_qwen(tmp_path_factory) -> str:
    from tests.engines.hf.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), tied=False, arch="qwen2")
