"""`metrics.jsonl` and the trackers (TensorBoard, W&B, MLflow): one line a logged step.

Every line of `RUN_DIR/metrics.jsonl` is a JSON object with `step` (1-based; a `step: 0`
line holds the evaluation before the first step) and the step's scalar metrics;
non-finite values are written as `null`. `peerflow report` plots
these names (a `<prefix>/*` group is plotted when any key of it exists):

Task and samples
    `reward/mean`, `reward/std`, `reward/min`, `reward/max` — task reward in [0, 1] for
    the built-in tasks (after a KL reward penalty, if any); `score/mean` — the raw reward
    before that penalty; `reward/<name>/mean` — each reward's own score;
    `reward/frac_zero_std` — share of prompt groups whose answers all got one reward.
    `response_length/mean`, `response_length/max` — generated tokens a sample;
    `response_length/clip_frac` — fraction that hit `max_tokens`; `prompt_length/mean`.
Evaluation (`run.eval_every`, `peerflow.worker.evaluation`)
    `eval/greedy/reward` — greedy (temperature 0) reward on the eval split,
    `eval/sampled/reward`, `eval/pass@k`, `eval/<greedy|sampled>/<reward name>`.
Algorithm
    `actor/loss`, `actor/entropy` (of the tempered policy, per response token),
    `actor/pg_loss`, `actor/clipfrac`, `actor/ppo_kl`, `actor/ratio_mean`,
    `actor/dual_clipfrac`, `actor/grad_norm`, `actor/lr` (from the losses in
    `peerflow.algorithms.losses` and the train engine); `actor/masked_fraction` — samples
    left out of the loss (overlong filtering, flat top-up groups, failed agent
    trajectories, samples whose reward failed under `task.reward_limits.on_failure`);
    `agent/env_errors` — agent trajectories the environment failed,
    `agent/env_dropped_fraction` — samples `rollout.agent.on_env_error` left out;
    `off_policy/is_weight_mean`, `off_policy/is_weight_max` — decoupled-PPO weights
    `exp(old_logprobs - rollout_logprobs)` before truncation,
    `off_policy/applied_weight_mean`, `off_policy/truncated_fraction` (`tis`) or
    `off_policy/masked_fraction` (`mis`);
    `mismatch/abs_mean`, `mismatch/abs_max` — |rollout - trainer log-prob| on the sampled
    tokens, `mismatch/kl` (k3) and `mismatch/kl_k1` — KL(π_rollout ‖ π_trainer);
    `critic/vf_loss`, `critic/vf_clipfrac`, `critic/vpred_mean`, `critic/grad_norm`;
    `kl/mean` (per-token KL to the reference), `kl/loss`, `kl/penalty_mean`;
    `advantages/mean`, `advantages/std`;
    `dynamic_sampling/kept_groups`, `dynamic_sampling/dropped_groups`,
    `dynamic_sampling/dropped_fraction`; `overlong/penalty_mean`,
    `overlong/filtered_fraction` (DAPO's overlong shaping and filtering).
Speed
    `throughput/tokens_per_s` — prompt + response tokens processed per wall second of the
    step; `throughput/samples_per_s`; `time/step` — wall seconds of the step;
    `time/iteration` — wall seconds of the training loop per step (the step and the
    previous step's metrics, hooks and checkpoint; sync mode);
    `time/<phase>` — seconds in each phase (`generate`, `reward`, `ref_logprob`,
    `old_logprob`, `values`, `advantage`, `train_actor`, `train_critic`, `sync_weights`,
    `checkpoint`, …), plotted as the step-time breakdown;
    `weight_sync/plan_s`, `weight_sync/gather_s`, `weight_sync/pack_s`,
    `weight_sync/wire_s`, `weight_sync/load_s` (slowest rank per phase),
    `weight_sync/pause_s` — seconds a rollout engine could not generate because of the
    sync; `weight_sync/bytes`, `weight_sync/wire_bytes` (sent to other ranks);
    `weight_sync/sender_share` — the busiest trainer rank's share of the bytes;
    with delta routes (`weight_sync.encoding`) `weight_sync/changed_elements` over
    `weight_sync/compared_elements` is the share of values that changed, and
    `weight_sync/full_sends` counts the routes sent whole.
Async mode
    `staleness/mean`, `staleness/max`, `staleness/<k>` (samples k versions old);
    `overlap/fraction` — share of wall time rollout and training ran at once;
    `idle/<role>` — seconds a role waited; `queue/<name>` — queue depths.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from peerflow.checkpoint.atomic import append_line
from peerflow.outputs.trackers import open_trackers

METRICS_FILE = "metrics.jsonl"


def _scalar(value: Any) -> float | int | None:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsWriter(contextlib.AbstractContextManager["MetricsWriter"]):
    """Appends step metrics to `metrics.jsonl` and mirrors them to the run's trackers.

    Create it on one rank (rank 0) after the ranks have reduced their metrics. Lines are
    appended, so a resumed run continues the same file (truncate it to the checkpoint's
    step first).

    Args:
        run_dir: The run directory.
        config: The `RunConfig`; `run.tensorboard`, `run.wandb` and `run.mlflow` switch
            the trackers (`peerflow.outputs.trackers`), `run.trackers` holds their
            options, and W&B and MLflow record the resolved config. `None`: JSONL and
            TensorBoard only.
        tensorboard: Overrides `config.run.tensorboard`.
        wandb: Overrides `config.run.wandb`.
        mlflow: Overrides `config.run.mlflow`.

    Raises:
        ConfigError: W&B or MLflow is on but its package is not installed.
    """

    def __init__(
        self, run_dir: str | Path, config: Any = None, *, tensorboard: bool | None = None,
        wandb: bool | None = None, mlflow: bool | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.trackers = open_trackers(self.run_dir, config, tensorboard=tensorboard,
                                      wandb=wandb, mlflow=mlflow)
        # one O_APPEND write a line (`append_line`): a line is whole or absent
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                       0o644)

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Appends one line (`step` first, then the metrics sorted by name) and mirrors it.

        Returns:
            The record written.
        """
        record: dict[str, Any] = {"step": int(step)}
        for name in sorted(metrics):
            if name != "step":
                record[name] = _scalar(metrics[name])
        if self._fd is None:
            raise ValueError(f"{self.path}: the metrics writer is closed.")
        append_line(self.path, json.dumps(record), fd=self._fd)  # OSError names the file
        if self.trackers:
            scalars = {k: v for k, v in record.items() if k != "step" and v is not None}
            self._to_trackers("log", step, scalars)
        return record

    def _to_trackers(self, method: str, *args: Any) -> None:
        """Calls `method` on every tracker; one that raises is dropped, saying so.

        A tracker server going away must not end a run whose metrics `metrics.jsonl`
        keeps anyway.
        """
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # noqa: BLE001 - any tracker or network error
                self.trackers.remove(tracker)
                print(f"peerflow: the {tracker.name} tracker failed ({type(exc).__name__}: "
                      f"{exc}); it gets nothing more this run, metrics.jsonl keeps every "
                      "step.", file=sys.stderr, flush=True)

    __call__ = write

    def log_samples(self, step: int, records: Sequence[Mapping[str, Any]], kind: str) -> None:
        """Mirrors the samples of `step` (`kind`: `train` or `eval`) to every tracker."""
        if records:
            self._to_trackers("log_samples", step, records, kind)

    def close(self, failed: bool = False) -> None:
        """Flushes and closes every sink (`failed`: the run ended in an error); idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._to_trackers("close", failed)
        self.trackers = []

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Reads `metrics.jsonl` (a run directory or the file itself).

    Raises:
        FileNotFoundError: naming the file looked for.
        ValueError: a line is not JSON or has no `step` (naming the line number).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; is this a PeerFlow run directory?")
    return read_json_lines(path, "metrics", required=("step",))


def read_json_lines(path: Path, what: str, *, required: tuple[str, ...] = ()
                    ) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one a line (blank lines skipped).

    A last line cut short (no newline; a writer older than `append_line` stopped by a
    full disk or a kill) is skipped, with a note on stderr.

    Raises:
        ValueError: a line is not a JSON object, or lacks a `required` key (naming the
            file, the 1-based line number and what a `what` line must be).
    """
    records = []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                print(f"peerflow: {path}:{number}: skipping the last line, cut short "
                      f"({len(line)} characters without an end).", file=sys.stderr)
                break
            raise ValueError(f"{path}:{number}: not a JSON object ({exc}).") from None
        if not isinstance(record, dict) or any(key not in record for key in required):
            keys = f" with {', '.join(repr(k) for k in required)}" if required else ""
            raise ValueError(f"{path}:{number}: a {what} line must be a JSON object{keys}.")
        records.append(record)
    return records
