"""Fixtures shared by the engine tests: tiny models built once per session."""

from __future__ import annotations

import pytest

from tests.engines.hf.tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_untied_qwen(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), tied=False, arch="qwen2")
