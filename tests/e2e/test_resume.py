"""Resume equals an uninterrupted run: 4 steps vs 2 steps + `--resume` for 2 more."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

#: Wall-clock measurements differ between any two runs; everything else must not.
TIMING_PREFIXES = ("time/", "throughput/", "weight_sync/")


def _comparable(line: dict) -> dict:
    return {k: v for k, v in line.items() if not k.startswith(TIMING_PREFIXES)}


def test_resume_equals_uninterrupted(tmp_path, quickstart, tiny, metrics_of, peerflow_train):
    common = [*tiny, "run.checkpoint_every=2"]
    full = tmp_path / "full"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(full)],
                   [*common, "run.steps=4"])
    part = tmp_path / "part"
    peerflow_train([quickstart, "--nprocs", "2", "--run-dir", str(part)],
                   [*common, "run.steps=2"])
    assert [m["step"] for m in metrics_of(part)] == [1, 2]
    peerflow_train(["--resume", str(part), "--nprocs", "2"], ["run.steps=4"])
    expected = [_comparable(m) for m in metrics_of(full)]
    resumed = [_comparable(m) for m in metrics_of(part)]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert resumed == expected
    # a resume trained: the later steps are not copies of the earlier ones
    assert resumed[2] != resumed[0]
