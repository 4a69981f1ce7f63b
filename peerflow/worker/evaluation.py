"""Held-out evaluation: the run's rewards on the task's eval split, greedy and sampled.

`evaluate` runs on every rank (the metrics are all-gathered): each rank hosting the
rollout engine generates for its dp-shard of the first `eval.max_prompts` prompts of
`eval.split` with the rollout engine's current weights, and scores the answers with the
same `RewardSet` the reward node uses. Metrics:

* `eval/greedy/reward` (and `eval/greedy/<reward>` per reward, `eval/greedy/response_length`)
  — one temperature-0 answer per prompt;
* `eval/sampled/reward`, `eval/pass@k` for k = 1, 2, 4, … ≤ `eval.n` — `eval.n` answers
  per prompt at `rollout.sampling.temperature`; an answer is correct when its reward is
  at least `eval.correct_threshold`; pass@k is the unbiased estimator of Chen et al.
  (2021), `1 - C(n - c, k) / C(n, k)`, averaged over prompts;
* `eval/prompts`.

`EvalHook` runs it from the run driver before the first step, every `run.eval_every`
steps and after the last step; `peerflow eval` calls it once on a checkpoint. In async
mode the trainer ranks call it from the driver after the step, and the rollout ranks —
which host the rollout engine and report no steps — from their streaming schedule once
they have loaded that step's weights (`RolloutSchedule`): the same collective, met by
every rank, on the weights the step produced. There a step is evaluated only when its
weights are pushed (every `weight_sync.every` steps, and the last).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import attrs

from peerflow.engines import SamplingParams
from peerflow.rollout.sampler import Draw
from peerflow.worker.metrics import StepMetrics, all_reduce_metrics

if TYPE_CHECKING:
    from peerflow.worker.runtime import WorkerRuntime


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `correct` of `n` samples right (`k <= n`)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.prod((n - correct - i) / (n - i) for i in range(k))


def eval_due(config: Any, step: int) -> bool:
    """Whether the run evaluates after `step` (0: before the first step).

    In async mode only steps whose weights reach the rollout ranks count (every
    `weight_sync.every` steps, and the last), since those ranks evaluate them.
    """
    every, last = config.run.eval_every, config.run.steps
    if not every or (step % every and step != last):
        return False
    pushed = max(config.weight_sync.every, 1)
    return config.runtime.mode != "async" or step % pushed == 0 or step == last


def _draws(rt: WorkerRuntime) -> list[Draw]:
    cfg = rt.config.eval
    size = rt.task.size(cfg.split)
    count = size if size is not None else cfg.max_prompts
    if cfg.max_prompts:
        count = min(count, cfg.max_prompts)
    return [Draw(position=i, example=rt.task.example(cfg.split, i, rt.config.seed))
            for i in range(rt.dp_rank, count, rt.dp_size)]


def _generate_and_score(rt: WorkerRuntime, draws: list[Draw], sampling: SamplingParams
                        ) -> tuple[Any, Any]:
    """Generates and scores; the batch keeps its `reward` and `reward_components`."""
    import torch

    from peerflow.worker.executors import REWARD_COMPONENTS, response_texts, score_texts

    batch = rt.generate_batch(rt.engine("rollout"), draws, sampling)
    scores = score_texts(rt.reward_set(), batch, response_texts(rt.tokenizer, batch), step=rt.step,
                         steps=rt.config.run.steps)
    batch.set("reward", torch.tensor(scores.total, dtype=torch.float32))
    batch.set_objects(REWARD_COMPONENTS, [
        {name: values[i] for name, values in scores.components.items()}
        for i in range(len(batch))])
    return batch, scores


def _record(metrics: StepMetrics, prefix: str, batch: Any, scores: Any) -> None:
    count = len(scores.total)
    metrics.mean(f"{prefix}/reward", sum(scores.total) / count, count)
    for name, (value, weight) in scores.metrics.items():
        if name.endswith("/mean"):
            metrics.mean(f"{prefix}/{name[len('reward/'):-len('/mean')]}", value, weight)
    for name, value in scores.counts.items():
        metrics.sum(f"{prefix}/{name[len('reward/'):]}", value)
    lengths = batch.trained_lengths().float()  # model tokens, as response_length/mean
    metrics.mean(f"{prefix}/response_length", float(lengths.mean()), count)


def evaluate(rt: WorkerRuntime, step: int) -> dict[str, float]:
    """Scores the eval split on this rank's share and returns the metrics of all ranks.

    Every sample goes to `samples/eval_step_<step>.jsonl` (rank 0 writes it;
    `peerflow.worker.samples.write_eval_samples`).

    Collective: every rank of the run must call it at the same point.
    """
    from peerflow.worker.samples import write_eval_samples

    cfg, sampling = rt.config.eval, rt.config.rollout.sampling
    metrics = StepMetrics()
    draws = _draws(rt) if "rollout" in rt.engines else []
    shown: list[tuple[str, Any]] = []
    if draws:
        metrics.sum("eval/prompts", len(draws))
        seed = (rt.config.seed * 7919 + step * 104_729 + rt.dp_rank) % (2**31 - 1)
        if cfg.greedy:
            greedy = SamplingParams(n=1, temperature=0.0, max_tokens=sampling.max_tokens,
                                    stop=tuple(sampling.stop), seed=seed)
            batch, scores = _generate_and_score(rt, draws, greedy)
            _record(metrics, "eval/greedy", batch, scores)
            shown.append(("greedy", batch))
        if cfg.n:
            sampled = attrs.evolve(sampling.to_params(seed=seed), n=cfg.n)
            batch, scores = _generate_and_score(rt, draws, sampled)
            _record(metrics, "eval/sampled", batch, scores)
            shown.append(("sampled", batch))
            correct: dict[int, int] = defaultdict(int)
            for group, score in zip(batch.group_id.tolist(), scores.total):
                correct[group] += score >= cfg.correct_threshold
            k = 1
            while k <= cfg.n:
                values = [pass_at_k(cfg.n, correct[d.position], k) for d in draws]
                metrics.mean(f"eval/pass@{k}", sum(values) / len(values), len(values))
                k *= 2
    write_eval_samples(rt, step, shown)
    return {k: v for k, v in all_reduce_metrics(metrics).items() if k.startswith("eval/")}


def _load_checkpoint(rt: WorkerRuntime, program: Any, checkpoint: str) -> int:
    """Loads a checkpoint into the trainable engines and syncs the rollout engine.

    `checkpoint` is a run directory (its newest verified checkpoint) or one of its
    `checkpoints/step_*` directories (verified against its manifest first).
    """
    from pathlib import Path

    from peerflow.checkpoint import restore_latest, trainable_engines, verify
    from peerflow.errors import ConfigError

    directory = Path(checkpoint).expanduser()
    if directory.name.startswith("step_") and directory.parent.name == "checkpoints":
        verdict = verify(directory)
        if not verdict.ok:
            raise ConfigError(f"--checkpoint {str(directory)!r} fails verification: "
                              f"{verdict.problem}; pick another step or the run directory.")
        step = int(directory.name.removeprefix("step_"))
        for role, engine in trainable_engines(rt.engines).items():
            engine.load_checkpoint(str(directory / role))
    else:
        resumed = restore_latest(directory, engines=rt.engines, rank=rt.rank)
        if resumed is None:
            raise ConfigError(f"--checkpoint {str(directory)!r}: no verified checkpoint under "
                              f"{directory / 'checkpoints'}; give a run directory or one of "
                              "its checkpoints/step_* directories.")
        step = resumed.step
    if any(getattr(n, "kind", "") == "sync_weights" for n in program.steps):
        rt.sync_weights()
    return step


def evaluate_checkpoint(rt: WorkerRuntime, program: Any, stage: Any,
                        checkpoint: str | None) -> dict[str, float]:
    """`peerflow eval`: loads `checkpoint`, evaluates, and (rank 0) writes `eval.json`."""
    step = 0
    if checkpoint:
        with stage("load checkpoint"):
            step = _load_checkpoint(rt, program, checkpoint)
    with stage(f"eval of step {step}"):
        metrics = evaluate(rt, step)
    if rt.rank == 0:
        record = {"checkpoint": checkpoint, "step": step, "metrics": metrics}
        from peerflow.checkpoint.atomic import write_json_atomic

        write_json_atomic(rt.run_dir / "eval.json", record)
    return metrics


@attrs.define(eq=False)
class EvalHook:
    """The run driver's hook (`peerflow.worker.driver.DriverHook`) for `run.eval_every`."""

    stage: Any
    """`peerflow.distributed.stage`, naming the evaluation if a rank dies in it."""

    def _run(self, rt: WorkerRuntime, step: int) -> dict[str, float] | None:
        if not eval_due(rt.config, step):
            return None
        with self.stage(f"eval after step {step}"):
            return evaluate(rt, step)

    def begin(self, rt: WorkerRuntime, start_step: int) -> dict[str, float] | None:
        """Evaluates the initial model (written as step 0) unless resuming."""
        return self._run(rt, 0) if start_step == 0 else None

    def end_step(self, rt: WorkerRuntime, step: int, metrics: dict[str, float]
                 ) -> dict[str, float] | None:
        """Evaluates after `step` when due."""
        return self._run(rt, step)
