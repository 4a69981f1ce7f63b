"""Renders a run's `metrics.jsonl` as PNG plots (matplotlib, Agg backend).

One figure per topic; a topic is drawn only when the run logged at least one of its
metrics (names in `peerflow.outputs.metrics`), and a panel only when its metric changed
during the run (a constant, such as the learning rate without a schedule, is listed in
`summary.json` under `constant` instead):

* `reward.png` — `reward/mean` with its min–max band, `score/mean`, `eval/greedy/reward`,
  `eval/sampled/reward`;
* `reward_components.png` — one panel per reward (`reward/<name>/mean`), when the task
  has several;
* `reward_spread.png` — `reward/std` and `reward/frac_zero_std` (share of prompt groups
  whose answers all got one reward: no learning signal for a group-relative estimator);
* `response_length.png` — `response_length/*`;
* `kl.png` — `kl/*`;
* `throughput.png` — `throughput/*`; `weight_sync.png` — `weight_sync/*` (or `sync/*`);
* `step_time.png` — `time/<phase>` stacked per step, with `time/step` on top;
* `training.png` — `actor/*`, `critic/*`;
* `off_policy.png` — `off_policy/*`: importance weights `π_prox / π_behav` (mean, max,
  fraction truncated or masked) of the decoupled-PPO correction;
* `mismatch.png` — `mismatch/*`: rollout-vs-trainer log-prob mismatch on the sampled
  tokens (mean and max |Δ log-prob|, KL(π_rollout ‖ π_trainer)), on a log scale that
  reaches 1 (a symmetric one for `mismatch/kl_k1`, which can be negative), so that
  round-off noise of 1e-13 stays at the bottom instead of filling the panel;
* `dapo.png` — `overlong/*`, `dynamic_sampling/*`;
* `staleness.png`, `overlap.png` — `staleness/*`; `overlap/*`, `idle/*`, `queue/*`;
* `eval.png` — `eval/*` (held-out evaluation: rewards, pass@k), one marker per evaluation.

`summary.json` records the number of training steps logged (the evaluation before the
first step, `step: 0`, is not one), the constant metrics, and, per metric, the first and
last value and the means of the first and last five logged values (the learning-curve
check of the quickstart).

Every file is written atomically (`peerflow.checkpoint.atomic.atomic_path`) into a
temporary created with `O_EXCL | O_NOFOLLOW` and renamed onto its name: a symbolic link
planted in `report/` is replaced, never written through, and a `RUN_DIR/report` that is
itself a link is refused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from peerflow.checkpoint.atomic import atomic_path
from peerflow.outputs.metrics import read_metrics

REPORT_DIR = "report"

#: `reward/<name>/mean` names that are not a reward's own score.
NOT_COMPONENTS = frozenset({"mean", "std", "min", "max", "frac_zero_std"})
#: Figures whose metrics share a log y axis.
LOG_SCALE = frozenset({"mismatch"})

#: (file stem, title, metric prefixes or exact names) of the line-plot figures.
LINE_FIGURES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("reward_components", "Reward components (each reward's own score)", ()),
    ("reward_spread", "Reward spread within a step", ("reward/std", "reward/frac_zero_std")),
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


def _components(records: Sequence[dict[str, Any]]) -> list[str]:
    """`reward/<name>/mean` of every reward, when the task has more than one."""
    names = [n for n in _names(records, ("reward/",)) if n.count("/") == 2
             and n.endswith("/mean") and n.split("/")[1] not in NOT_COMPONENTS]
    return names if len(names) > 1 else []


def constant(records: Sequence[dict[str, Any]], name: str) -> bool:
    """Whether `name` kept one value over every step that logged it."""
    return len(set(_series(records, name)[1])) <= 1


def figure_panels(records: Sequence[dict[str, Any]]) -> dict[str, list[str]]:
    """The line figures to draw and the metric of each of their panels, by file stem.

    A panel per metric that changed during the run; a figure without one is left out.
    """
    figures = {}
    for stem, _, prefixes in LINE_FIGURES:
        names = _components(records) if stem == "reward_components" else _names(records,
                                                                                 prefixes)
        names = [name for name in names if not constant(records, name)]
        if names:
            figures[stem] = names
    return figures


def summarize(records: Sequence[dict[str, Any]], window: int = 5) -> dict[str, Any]:
    """Training steps logged, constant metrics, and each metric's first and last values.

    Per metric: `first`, `last`, and `first_mean`/`last_mean` over `window` logged values.
    """
    names = sorted({k for r in records for k in r if k != "step"})
    summary: dict[str, Any] = {"steps": len({int(r["step"]) for r in records if r["step"]})}
    metrics, constants = {}, {}
    for name in names:
        _, values = _series(records, name)
        if values:
            metrics[name] = {
                "first": values[0], "last": values[-1],
                "first_mean": sum(values[:window]) / len(values[:window]),
                "last_mean": sum(values[-window:]) / len(values[-window:]),
            }
            if len(values) > 1 and len(set(values)) == 1:
                constants[name] = values[0]
    summary["metrics"] = metrics
    summary["constant"] = constants
    return summary


def write_file(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Writes `path` atomically, never through a symbolic link planted in the folder.

    `write` fills a file created exclusively (`O_EXCL | O_NOFOLLOW`) under a fresh name
    beside `path` (`atomic_path`); renaming it onto `path` replaces whatever `path` was —
    a link is replaced, its target left alone.
    """
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as handle:
            write(handle)


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
        ValueError: the file is malformed or has no metrics lines, or the default
            `RUN_DIR/report` is a symbolic link.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{Path(run_dir) / 'metrics.jsonl'} has no lines yet; nothing to plot.")
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / REPORT_DIR
    if out_dir is None and out.is_symlink():
        raise ValueError(f"{out} is a symbolic link (to {os.readlink(out)}); the report is "
                         "not written through it. Remove it, or choose a folder with --out.")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(fig: Any, stem: str) -> None:
        path = out / f"{stem}.png"
        fig.tight_layout()
        write_file(path, lambda handle: fig.savefig(handle, format="png", dpi=100))
        plt.close(fig)
        written.append(path)

    if _names(records, ("reward/", "score/", "eval/")):
        fig, ax = plt.subplots(figsize=(7, 4))
        _plot_reward(ax, records, smooth)
        save(fig, "reward")

    titles = {stem: title for stem, title, _ in LINE_FIGURES}
    for stem, names in figure_panels(records).items():
        title = titles[stem]
        fig, axes = plt.subplots(len(names), 1, figsize=(7, 2.2 * len(names) + 0.6),
                                 sharex=True, squeeze=False)
        for ax, name in zip(axes[:, 0], names):
            s, v = _series(records, name)
            ax.plot(s, _smooth(v, smooth), marker="o" if name.startswith("eval/") else None)
            if stem in LOG_SCALE:
                _log_scale(ax, v)
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
    text = json.dumps(summarize(records), indent=1, sort_keys=True)
    write_file(summary_path, lambda handle: handle.write(text.encode()))
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


def _log_scale(ax: Any, values: Sequence[float]) -> None:
    """A log y axis reaching at least 1 (symmetric log when a value is 0 or negative)."""
    top = max(1.0, max(abs(v) for v in values) * 2)
    positive = [v for v in values if v > 0]
    if len(positive) == len(values):
        ax.set_yscale("log")
        ax.set_ylim(min(positive) / 2, top)
    else:
        ax.set_yscale("symlog", linthresh=1e-8)
        ax.set_ylim(-top if min(values) < 0 else 0.0, top)


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
