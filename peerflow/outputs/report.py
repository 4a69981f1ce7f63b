"""Renders a run's `metrics.jsonl` as PNG plots (matplotlib, Agg backend).

One figure per topic; a topic is drawn only when the run logged at least one of its
metrics (names in `peerflow.outputs.metrics`):

* `reward.png` — `reward/mean` with its min–max band, `score/mean`, `eval/greedy/reward`,
  `eval/sampled/reward`;
* `response_length.png` — `response_length/*`;
* `kl.png` — `kl/*`;
* `throughput.png` — `throughput/*`; `weight_sync.png` — `weight_sync/*` (or `sync/*`);
* `step_time.png` — `time/<phase>` stacked per step, with `time/step` on top;
* `training.png` — `actor/*`, `critic/*`;
* `off_policy.png` — `off_policy/*`: importance weights `π_prox / π_behav` (mean, max,
  fraction truncated or masked) of the decoupled-PPO correction;
* `mismatch.png` — `mismatch/*`: rollout-vs-trainer log-prob mismatch on the sampled
  tokens (mean and max |Δ log-prob|, KL(π_rollout ‖ π_trainer));
* `dapo.png` — `overlong/*`, `dynamic_sampling/*`;
* `staleness.png`, `overlap.png` — `staleness/*`; `overlap/*`, `idle/*`, `queue/*`;
* `eval.png` — `eval/*` (held-out evaluation: rewards, pass@k), one marker per evaluation.

`summary.json` records, per metric, the first and last value and the means of the first
and last five logged steps (the learning-curve check of the quickstart).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peerflow.outputs.metrics import read_metrics

REPORT_DIR = "report"

#: (file stem, title, metric prefixes) of the simple line-plot figures.
LINE_FIGURES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("response_length", "Response length (tokens)", ("response_length/",)),
    ("kl", "KL to the reference model", ("kl/",)),
    ("throughput", "Throughput", ("throughput/",)),
    ("weight_sync", "Weight sync (seconds, bytes)", ("weight_sync/", "sync/")),
    ("training", "Losses and optimiser", ("actor/", "critic/")),
    ("off_policy", "Off-policy correction: importance weights", ("off_policy/",)),
    ("mismatch", "Rollout vs trainer log-prob mismatch", ("mismatch/",)),
    ("dapo", "DAPO: overlong shaping, dynamic sampling", ("overlong/", "dynamic_sampling/")),
    ("staleness", "Staleness (weight versions)", ("staleness/",)),
    ("overlap", "Overlap, idle time and queues", ("overlap/", "idle/", "queue/")),
    ("eval", "Held-out evaluation (run.eval_every)", ("eval/",)),
)


def _series(records: Sequence[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in records:
        value = record.get(name)
        if isinstance(value, int | float) and math.isfinite(value):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def _smooth(values: list[float], window: int) -> list[float]:
    if window <= 1:
        return values
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _names(records: Sequence[dict[str, Any]], prefixes: Sequence[str]) -> list[str]:
    found = {k for r in records for k in r if k != "step" and k.startswith(tuple(prefixes))}
    return sorted(found)


def summarize(records: Sequence[dict[str, Any]], window: int = 5) -> dict[str, Any]:
    """Per metric: `first`, `last`, `first_mean`/`last_mean` over `window` logged steps."""
    names = sorted({k for r in records for k in r if k != "step"})
    summary: dict[str, Any] = {"steps": len(records)}
    metrics = {}
    for name in names:
        _, values = _series(records, name)
        if values:
            metrics[name] = {
                "first": values[0], "last": values[-1],
                "first_mean": sum(values[:window]) / len(values[:window]),
                "last_mean": sum(values[-window:]) / len(values[-window:]),
            }
    summary["metrics"] = metrics
    return summary


def render_report(
    run_dir: str | Path, out_dir: str | Path | None = None, *, smooth: int = 1
) -> list[Path]:
    """Writes the PNG plots and `summary.json` of a run; returns the files written.

    Args:
        run_dir: A run directory holding `metrics.jsonl`.
        out_dir: Where to write (default `RUN_DIR/report`).
        smooth: Moving-average window applied to every curve (1: raw).

    Raises:
        FileNotFoundError: no `metrics.jsonl` in `run_dir`.
        ValueError: the file is malformed or has no metrics lines.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} has no lines yet; nothing to plot.")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, stem: str) -> None:
        path = out / f"{stem}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    if _names(records, ("reward/", "score/", "eval/")):
        fig, ax = plt.subplots(figsize=(7, 4))
        _plot_reward(ax, records, smooth)
        save(fig, "reward")

    for stem, title, prefixes in LINE_FIGURES:
        names = _names(records, prefixes)
        if not names:
            continue
        fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.2 * len(names) + 0.6),
                                 sharex=True, squeeze=False)
        for ax, name in zip(axes[:, 0], names):
            s, v = _series(records, name)
            ax.plot(s, _smooth(v, smooth), marker="o" if name.startswith("eval/") else None)
            ax.set_ylabel(name, fontsize=8)
            ax.grid(alpha=0.3)
        axes[0, 0].set_title(title)
        axes[-1, 0].set_xlabel("step")
        save(fig, stem)

    phases = [n for n in _names(records, ("time/",)) if n not in ("time/step", "time/iteration")]
    if phases or _series(records, "time/step")[1]:
        fig, ax = plt.subplots(figsize=(7, 4))
        _plot_step_time(ax, records, phases)
        save(fig, "step_time")

    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps(summarize(records), indent=1, sort_keys=True))
    written.append(summary_path)
    return written


def _plot_reward(ax: Any, records: Sequence[dict[str, Any]], smooth: int) -> None:
    """Draws reward mean (with its min–max band), score and eval rewards on `ax`."""
    steps, mean = _series(records, "reward/mean")
    if mean:
        ax.plot(steps, _smooth(mean, smooth), label="reward/mean")
        lo_steps, lo = _series(records, "reward/min")
        hi_steps, hi = _series(records, "reward/max")
        if lo and hi and lo_steps == hi_steps:
            ax.fill_between(lo_steps, lo, hi, alpha=0.15, label="min–max")
    for name in ("score/mean", "eval/greedy/reward", "eval/sampled/reward"):
        s, v = _series(records, name)
        if v:
            ax.plot(s, _smooth(v, smooth), label=name, marker="o" if "eval" in name else None)
    ax.set(title="Reward", xlabel="step", ylabel="reward")
    ax.legend()
    ax.grid(alpha=0.3)


def _plot_step_time(ax: Any, records: Sequence[dict[str, Any]], phases: list[str]) -> None:
    """Draws the per-phase step times stacked, and the wall step time, on `ax`."""
    steps = [int(r["step"]) for r in records]
    bottom = [0.0] * len(records)
    for name in phases:
        values = [float(r.get(name) or 0.0) for r in records]
        ax.bar(steps, values, bottom=bottom, label=name[len("time/"):], width=0.9)
        bottom = [b + v for b, v in zip(bottom, values)]
    s, v = _series(records, "time/step")
    if v:
        ax.plot(s, v, color="black", label="step (wall)")
    ax.set(title="Step time breakdown", xlabel="step", ylabel="seconds")
    ax.legend(fontsize=7, ncol=2)
