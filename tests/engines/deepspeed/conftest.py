"""The two-rank DeepSpeed runs: a test module names its `WORKER` script; these fixtures run
it once on two gloo ranks over a tiny tied Llama and load what each rank wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engines.deepspeed.trainlib import build_model
from tests.helpers.gloo import run_script


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return build_model(tmp_path_factory.mktemp("ds-llama"), "llama", tied=True)


@pytest.fixture(scope="module")
def run_dir(request, tiny, tmp_path_factory) -> Path:
    """The module's `WORKER` output: `rank{R}.pt` and the checkpoints `ckpt{stage}`."""
    out = tmp_path_factory.mktemp("ds-run")
    run_script(request.module.WORKER, tiny, str(out))
    return out


@pytest.fixture(scope="module")
def ranks(run_dir) -> list[dict]:
    """What each of the two ranks wrote (`rank0.pt`, `rank1.pt`)."""
    return [torch.load(run_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]
