"""What `peerflow train` prints: a line per step, the end-of-run summary, no library bars."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.distributed


def test_step_lines_and_summary_without_library_progress_bars(quickstart_run):
    run_dir = quickstart_run  # 4 steps on 2 processes, checkpoints at steps 2 and 4
    out = (run_dir.parent / "terminal.txt").read_text()
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/4", "2/4", "3/4", "4/4"], out
    number = r"-?[\d.]+(?:e[-+]\d+)?"
    for line in steps:  # the numbers RL users watch, every logged step
        assert re.search(rf"reward {number}±{number}  loss {number}  grad {number}  "
                         rf"entropy {number}  len {number}  {number}k? tok/s  {number}s$",
                         line), line
        assert " kl " not in line  # the quickstart has no KL term
    # transformers drew "Loading weights" bars per worker and engine, and one writing the
    # freshly built model; the workers switch them off
    assert "Loading weights" not in out and "Writing model shards" not in out
    assert "it/s]" not in out
    summary = out[out.index("peerflow: run finished 4 steps"):]
    assert f"(sync mode): {run_dir}" in summary
    assert re.search(r"reward +[\d.e-]+ → [\d.e-]+ \(means of the first and last 2 logged "
                     r"steps; best [\d.e-]+ at step [1-4]\)", summary), summary
    assert f"checkpoint {run_dir / 'checkpoints' / 'step_000004'}" in summary
    assert f"samples    {run_dir / 'samples'}" in summary
    for command in (f"peerflow samples {run_dir} --worst", f"peerflow report {run_dir}",
                    f"peerflow export {run_dir} OUT_DIR"):
        assert command in summary
