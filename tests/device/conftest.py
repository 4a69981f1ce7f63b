"""Tests of device code on the emulated accelerator (`peerflow.testing.emulated_device`).

The `on_device_*.py` modules run only inside a pytest process of their own started with
`PEERFLOW_EMULATE_ACCELERATOR=1` (by `test_on_emulated_device.py`): the emulation is
process-wide and cannot be undone, so it never enters the shared test workers. There this
conftest installs it before any test runs a backward pass.
"""

from __future__ import annotations

import os

import pytest
import torch

from peerflow.testing.autoload import ENV_VAR as EMULATE_ENV

EMULATED = os.environ.get(EMULATE_ENV) == "1"
if EMULATED:
    from peerflow.testing.emulated_device import install

    DEVICE = install()


@pytest.fixture
def device() -> torch.device:
    """The emulated accelerator this process computes on."""
    if not EMULATED:
        pytest.skip(f"runs on the emulated accelerator only ({EMULATE_ENV}=1)")
    return DEVICE
