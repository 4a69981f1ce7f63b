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
