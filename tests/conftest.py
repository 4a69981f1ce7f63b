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


#: Unit modules left out of the quick lane: each test starts processes, a sandbox, pyright
#: or an engine (seconds a test). They run in the default run.
NOT_QUICK = frozenset({
    "test_emulated_device", "test_static_imports", "test_sandbox_escapes",
    "test_code_reward_forgeries", "test_plugins", "test_example_plugin",
    "test_sandbox_host_root", "test_cli", "test_emulation_autoload", "test_sandbox_server",
    "test_rewards", "test_reward_faults", "test_sandbox_rewards", "test_agent_tools",
    "test_trackers", "test_agent_tools_driver", "test_verifiers", "test_reasoning_gym",
    "test_config_refusals", "test_import_light", "test_plugin_load_errors",
    "test_worker_crash_stacks",
})


def _quick(item: pytest.Item) -> bool:
    """The inner loop: unit tests, and conformance layers 0–2 (no engine is built)."""
    if item.get_closest_marker("slow") or item.get_closest_marker("distributed"):
        return False
    layer = item.get_closest_marker("peerflow_layer")
    if layer is not None:
        return layer.args[0] <= 2
    path = item.path
    return path.parent.name == "unit" and path.stem not in NOT_QUICK


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks the quick lane (`pytest -m quick`, README: "The inner loop")."""
    for item in items:
        if _quick(item):
            item.add_marker(pytest.mark.quick)
