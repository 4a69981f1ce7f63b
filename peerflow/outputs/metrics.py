"""`metrics.jsonl`, TensorBoard and W&B: one writer, one line per logged step.

Every line of `RUN_DIR/metrics.jsonl` is a JSON object with `step` (1-based) and the
step's scalar metrics; non-finite values are written as `null`. `peerflow report` plots
these names (a `<prefix>/*` group is plotted when any key of it exists):

Task and samples
    `reward/mean`, `reward/std`, `reward/min`, `reward/max` — task reward in [0, 1] for
    the built-in tasks (after a KL reward penalty, if any); `score/mean` — the raw reward
    before that penalty; `eval/reward/mean` — greedy reward on the eval split.
    `response_length/mean`, `response_length/max` — generated tokens a sample;
    `response_length/clip_frac` — fraction that hit `max_tokens`; `prompt_length/mean`.
Algorithm
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
    `weight_sync/plan_s`, `weight_sync/pack_s`, `weight_sync/wire_s`,
    `weight_sync/load_s`, `weight_sync/bytes`.
Async mode
    `staleness/mean`, `staleness/max`, `staleness/<k>` (samples k versions old);
    `overlap/fraction` — share of wall time rollout and training ran at once;
    `idle/<role>` — seconds a role waited; `queue/<name>` — queue depths.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
#: Seconds between TensorBoard's writes to disk (and at close).
TENSORBOARD_FLUSH_S = 5


def _scalar(value: Any) -> float | int | None:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    value = float(value)
    return value if math.isfinite(value) else None


def _tensorboard_summary(record: Mapping[str, Any]) -> Any:
    """One TensorBoard `Summary` holding every scalar of a step (`null`s left out).

    Each value is what `SummaryWriter.add_scalar` writes (`simple_value`); one event per
    step instead of one per metric saves the reporting rank ~50 protobuf events and
    writer-thread hand-offs a step, while the rest of the job waits for it.
    """
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=name, simple_value=float(value))
                          for name, value in record.items()
                          if name != "step" and value is not None])


class MetricsWriter(contextlib.AbstractContextManager["MetricsWriter"]):
    """Appends step metrics to `metrics.jsonl` and mirrors them to TensorBoard and W&B.

    Create it on one rank (rank 0) after the ranks have reduced their metrics. Lines are
    appended, so a resumed run continues the same file (truncate it to the checkpoint's
    step first).

    Args:
        run_dir: The run directory.
        config: The `RunConfig`; `run.tensorboard` and `run.wandb` switch the mirrors
            and W&B records the resolved config. `None`: JSONL and TensorBoard only.
        tensorboard: Overrides `config.run.tensorboard`.
        wandb: Overrides `config.run.wandb`; ignored (with a note on stderr) when the
            `wandb` package is not installed.
    """

    def __init__(
        self, run_dir: str | Path, config: Any = None, *, tensorboard: bool | None = None,
        wandb: bool | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._file = self.path.open("a", encoding="utf-8")
        settings = getattr(config, "run", None)
        use_tb = tensorboard if tensorboard is not None else getattr(settings, "tensorboard", True)
        use_wandb = wandb if wandb is not None else getattr(settings, "wandb", False)
        self._tb = self._open_tensorboard() if use_tb else None
        self._wandb = self._open_wandb(config) if use_wandb else None

    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard.writer import FileWriter
        except ImportError as exc:  # tensorboard missing: keep the JSONL going
            print(f"peerflow: TensorBoard disabled ({exc}); pip install tensorboard",
                  file=sys.stderr)
            return None
        # The writer's own thread writes events to disk every few seconds; flushing at
        # every step instead made the reporting rank wait for that thread each step.
        return FileWriter(str(self.run_dir / TENSORBOARD_DIR), flush_secs=TENSORBOARD_FLUSH_S)

    def _open_wandb(self, config: Any) -> Any:
        if importlib.util.find_spec("wandb") is None:
            print("peerflow: run.wandb is true but wandb is not installed; pip install wandb "
                  "(metrics still go to metrics.jsonl and TensorBoard).", file=sys.stderr)
            return None
        import wandb

        plain = None
        if config is not None:
            from peerflow.config import unstructure

            plain = unstructure(config)
        return wandb.init(project="peerflow", dir=str(self.run_dir), config=plain,
                          name=self.run_dir.name, resume="allow", id=self.run_dir.name)

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Appends one line (`step` first, then the metrics sorted by name) and mirrors it.

        Returns:
            The record written.
        """
        record: dict[str, Any] = {"step": int(step)}
        for name in sorted(metrics):
            if name != "step":
                record[name] = _scalar(metrics[name])
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb.add_summary(_tensorboard_summary(record), global_step=step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        return record

    __call__ = write

    def close(self) -> None:
        """Flushes and closes every sink. Safe to call twice."""
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __exit__(self, *exc: object) -> None:
        self.close()


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

    Raises:
        ValueError: a line is not a JSON object, or lacks a `required` key (naming the
            file, the 1-based line number and what a `what` line must be).
    """
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not a JSON object ({exc}).") from None
        if not isinstance(record, dict) or any(key not in record for key in required):
            keys = f" with {', '.join(repr(k) for k in required)}" if required else ""
            raise ValueError(f"{path}:{number}: a {what} line must be a JSON object{keys}.")
        records.append(record)
    return records
