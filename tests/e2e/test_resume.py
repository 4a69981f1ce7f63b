"""Resume equals an uninterrupted run: 4 steps vs 2 steps + `--resume` for 2 more.

Then the newest checkpoint is truncated: the resume falls back to the previous verified
one, says so, and still reproduces the uninterrupted run.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

#: Wall-clock, CPU-time and memory measurements differ between any two runs; everything
#: else must not.
TIMING_PREFIXES = ("time/", "throughput/", "weight_sync/", "coordinator/", "memory/")


def _comparable(line: dict) -> dict:
    return {k: v for k, v in line.items() if not k.startswith(TIMING_PREFIXES)}


def test_resume_equals_uninterrupted(tmp_path, quickstart, tiny, metrics_of, peerflow_train,
                                    quickstart_run):
    # the uninterrupted run: the shared 4-step run, with the settings of `common`
    common = [*tiny, "run.checkpoint_every=2", "run.trace=true"]
    full = quickstart_run
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

    # a truncated newest checkpoint: reported (step and file), the previous one is used
    shard = part / "checkpoints" / "step_000004" / "actor" / "model-rank1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    proc = peerflow_train(["--resume", str(part), "--nprocs", "2"], ["run.steps=4"])
    assert "step 4" in proc.stdout and "actor/model-rank1.safetensors" in proc.stdout
    assert "resuming from step 2" in proc.stdout
    assert [_comparable(m) for m in metrics_of(part)] == expected
