"""`peerflow report`: plots and summary from metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from peerflow.cli import main
from peerflow.outputs import MetricsWriter
from peerflow.outputs.report import render_report, summarize


def write_run(run_dir, steps=12, async_metrics=False):
    with MetricsWriter(run_dir, tensorboard=False) as writer:
        for step in range(1, steps + 1):
            metrics = {
                "reward/mean": step / steps, "reward/min": 0.0, "reward/max": 1.0,
                "response_length/mean": 4.0 + step, "kl/mean": 0.01 * step,
                "throughput/tokens_per_s": 1000.0 + step, "time/step": 1.0,
                "time/generate": 0.6, "time/train_actor": 0.3, "actor/pg_loss": -0.1 / step,
                "actor/lr": 1e-6,
            }
            if async_metrics:
                metrics |= {"staleness/mean": step % 2, "overlap/fraction": 0.7 + 0.01 * step,
                            "queue/depth": 3,
                            "off_policy/is_weight_mean": 1.01, "off_policy/is_weight_max": 2.5,
                            "off_policy/truncated_fraction": 0.01 * step,
                            "mismatch/abs_mean": 0.02 * step, "mismatch/abs_max": 0.9,
                            "mismatch/kl": 0.001}
            writer(step, metrics)


def test_report_renders_pngs_and_summary(tmp_path):
    write_run(tmp_path)
    files = render_report(tmp_path, smooth=3)
    names = sorted(p.name for p in files)
    assert names == ["kl.png", "response_length.png", "reward.png", "step_time.png",
                     "summary.json", "throughput.png", "training.png"]
    for path in files:
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    reward = summary["metrics"]["reward/mean"]
    assert reward["first_mean"] == pytest.approx(3 / 12)  # steps 1-5: mean 3 / 12
    assert reward["last_mean"] == pytest.approx(10 / 12)  # steps 8-12: mean 10 / 12


def test_async_metrics_add_staleness_and_overlap_plots(tmp_path):
    write_run(tmp_path, steps=3, async_metrics=True)
    names = {p.name for p in render_report(tmp_path, tmp_path / "out")}
    assert {"staleness.png", "overlap.png", "off_policy.png", "mismatch.png"} <= names


def test_report_cli_prints_the_off_policy_summary(tmp_path, capsys):
    write_run(tmp_path, steps=6, async_metrics=True)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "off_policy/is_weight_max: first 5 steps 2.5" in out
    assert "mismatch/kl: first 5 steps 0.001" in out


def test_summarize_skips_missing_values():
    records = [{"step": 1, "a": 1.0}, {"step": 2, "a": None, "b": 2.0}, {"step": 3, "a": 3.0}]
    summary = summarize(records, window=1)
    assert summary["metrics"]["a"] == {"first": 1.0, "last": 3.0, "first_mean": 1.0,
                                       "last_mean": 3.0}
    assert summary["metrics"]["b"]["first"] == 2.0


def test_report_cli(tmp_path, capsys):
    write_run(tmp_path, steps=10)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reward.png" in out and "reward/mean: first 5 steps 0.300, last 5 steps 0.800" in out
    assert main(["report", str(tmp_path / "missing")]) == 1
    assert "PeerFlow run directory" in capsys.readouterr().err


def _records(steps: int = 6) -> list[dict]:
    """A GRPO run with two rewards, a step-0 evaluation and 1e-13 log-prob noise."""
    records = [{"step": 0, "eval/greedy/reward": 0.1}]
    for step in range(1, steps + 1):
        records.append({
            "step": step, "reward/mean": 0.1 * step, "reward/std": 0.3 / step,
            "reward/frac_zero_std": 0.5 if step % 2 else 0.25, "reward/min": 0.0,
            "reward/max": 1.0, "reward/errors": 0.0, "reward/correct/mean": 0.1 * step,
            "reward/format/mean": 1.0 - 0.05 * step, "actor/lr": 1e-6,
            "actor/grad_norm": 1.0 / step, "mismatch/abs_max": 1e-13 * step,
            "mismatch/kl_k1": (-1) ** step * 1e-14,
        })
    return records


def test_report_panels_components_spread_no_constants_log_mismatch(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from peerflow.outputs.report import _log_scale, figure_panels

    records = _records()
    panels = figure_panels(records)
    # one panel per reward, the spread beside the mean; a reward's mean is not a component
    assert panels["reward_components"] == ["reward/correct/mean", "reward/format/mean"]
    assert panels["reward_spread"] == ["reward/frac_zero_std", "reward/std"]
    # constants (learning rate, min, max, errors) get no panel
    assert panels["training"] == ["actor/grad_norm"]
    assert all("actor/lr" not in names and "reward/errors" not in names
               for names in panels.values())
    assert panels["mismatch"] == ["mismatch/abs_max", "mismatch/kl_k1"]
    fig, (ax, signed) = plt.subplots(2)
    _log_scale(ax, [1e-13, 2e-13, 3e-13])
    _log_scale(signed, [-1e-14, 1e-14])
    assert ax.get_yscale() == "log" and ax.get_ylim()[1] >= 1.0  # noise stays at the bottom
    assert signed.get_yscale() == "symlog" and signed.get_ylim() == (-1.0, 1.0)
    plt.close(fig)
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        for record in records:
            writer(record["step"], {k: v for k, v in record.items() if k != "step"})
    written = {p.name for p in render_report(tmp_path)}
    assert {"reward_components.png", "reward_spread.png", "mismatch.png"} <= written
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["steps"] == 6  # the step-0 evaluation is not a training step
    assert summary["constant"]["actor/lr"] == 1e-6 and "reward/mean" not in summary["constant"]


def test_a_single_reward_draws_no_component_panel():
    from peerflow.outputs.report import figure_panels

    records = [{k: v for k, v in r.items() if k != "reward/format/mean"} for r in _records()]
    assert "reward_components" not in figure_panels(records)
