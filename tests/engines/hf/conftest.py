"""Fixtures: tiny models built once per session in a temporary directory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# `tests.…` imports need the repository root on sys.path (as `python -m pytest` gives);
# the lead may replace this with `pythonpath = ["."]` in the pytest settings.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.engines.hf.tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_untied_qwen(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), tied=False, arch="qwen2")
