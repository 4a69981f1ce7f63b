"""Node executors: what a worker does for each workflow node kind.

An executor is `fn(context, batch) -> batch`, run with the same `NodeContext` a plugin's
node gets. It reads the fields its node declares as inputs from this rank's batch and adds
its outputs; fields it does not know travel untouched. `peerflow.worker.nodes` registers
each as a node kind, like a plugin's.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import torch

from peerflow.algorithms.base import dataset_row
from peerflow.batch import Batch
from peerflow.distributed import describe_stage
from peerflow.rollout.generate import group_count, step_seed
from peerflow.rollout.sampler import split_evenly
from peerflow.worker.metrics import REWARD_COMPONENTS, StepMetrics

if TYPE_CHECKING:
    from peerflow.worker.node_context import NodeContext

#: Object field: per sample, the names of the rewards that failed on it (set by reward
#: nodes; counted into `reward/failed_samples` and `reward/<name>/failed`).
REWARD_ERRORS = "reward_errors"

Executor = Callable[["NodeContext", Batch], Batch]


def _sampling(ctx: NodeContext, attempt: int) -> Any:
    return ctx.config.rollout.sampling.to_params(
        seed=step_seed(ctx.config.seed, ctx.step, ctx.dp_rank, attempt)
    )


def response_texts(tokenizer: Any, batch: Batch) -> list[str]:
    """The decoded answers of a batch (special tokens removed), as rewards read them."""
    return tokenizer.batch_decode(
        [row.tolist() for row in batch.ragged("response_ids").rows()], skip_special_tokens=True
    )


def score_texts(rewards: Any, batch: Batch, texts: list[str], *, step: int = 0,
                steps: int = 0) -> Any:
    """Scores decoded answers with a `RewardSet`; returns its `RewardScores`.

    TRL-style rewards also get the answers' token ids and the step
    (`peerflow.rewards.trl_style`). Agent episodes (`env_reward` in the batch) keep their
    environment's outcome reward (`Environment.final_reward`) where it gave one; the
    task's rewards score only the others (so a task reward the environment made unused is
    neither computed nor shown). Named rewards an environment returned join the
    components (NaN where it gave none).
    """
    ids = [row.tolist() for row in batch.ragged("response_ids").rows()]
    env = batch["env_reward"].tolist() if "env_reward" in batch else [math.nan] * len(batch)
    rest = [i for i, e in enumerate(env) if math.isnan(e)]
    if not rest:  # the environments scored every episode: the task's rewards never run
        from peerflow.rewards.scoring import RewardScores

        scores = RewardScores(total=[], metrics={}, counts={}, failed=[])
    else:
        scores = rewards.score([texts[i] for i in rest], [batch["example"][i] for i in rest],
                               [int(batch.sample_id[i]) for i in rest],
                               context={"completion_ids": [ids[i] for i in rest],
                                        "step": step, "steps": steps})
    if len(rest) == len(batch):
        return scores
    total, failed = list(env), [False] * len(batch)
    components = {name: [math.nan] * len(batch) for name in scores.components}
    for k, i in enumerate(rest):
        total[i], failed[i] = scores.total[k], scores.failed[k]
        for name, values in scores.components.items():
            components[name][i] = values[k]
    means = dict(scores.metrics)
    named = batch["env_reward_components"] if "env_reward_components" in batch else []
    for name in sorted({k for row in named for k in row}):  # the environment's own rewards
        values = [row.get(name, math.nan) for row in named]
        given = [v for v in values if not math.isnan(v)]
        components[name] = values
        means[f"reward/{name}/mean"] = (sum(given) / len(given), len(given))
    return attrs.evolve(scores, total=total, failed=failed, components=components,
                        metrics=means)


def _score(ctx: NodeContext, batch: Batch) -> None:
    """Decodes the answers, adds `response_text` and the node's reward field.

    The rewards are `node.options["reward"]` when the node names one, else the run's
    (`task.reward` / `task.rewards`); the field is the node's first output (`reward` by
    default), so several reward nodes can feed one advantage node under different names
    (fan-in). Per-reward means and the `reward/errors` / `reward/timeouts` counts go
    into `metrics`; the samples a reward failed on are marked `reward_failed` (with
    several reward nodes: any of them). Agent episodes keep their environment's outcome
    reward (`score_texts`).
    """
    from peerflow.algorithms.failed_samples import REWARD_FAILED, reward_failures

    node, metrics = ctx.node, ctx.metrics
    texts = response_texts(ctx.tokenizer, batch)
    options = getattr(node, "options", None) or {}
    rewards = ctx.rewards(options.get("reward"))
    describe_stage(f"reward {', '.join(c.name for c in rewards.components)!r} on "
                   f"{_samples(batch)}")
    step = max(ctx.step, int(batch.weight_version.max()) + 1) if len(batch) else ctx.step
    scores = score_texts(rewards, batch, texts, step=step, steps=ctx.config.run.steps)
    if scores.errors:
        from peerflow.outputs.reward_errors import append_reward_errors

        append_reward_errors(ctx.run_dir, step, ctx.rank, scores.errors)
    if "agent_error" in batch:  # every failed episode, with its traceback
        from peerflow.agents.failure_log import append_agent_errors

        append_agent_errors(ctx.run_dir, step, ctx.rank, batch)
    _add_failures(batch, scores)
    if metrics is not None:  # each reward's mean: `record_batch_metrics`, in both modes
        means = {f"reward/{name}/mean" for name in scores.components}
        for name, (value, count) in scores.metrics.items():
            if name not in means:
                metrics.mean(name, value, count)
        for name, count in scores.counts.items():
            metrics.sum(name, count)
    outputs = tuple(getattr(node, "outputs", ()) or ("reward",))
    batch.set_objects("response_text", texts)
    _add_components(batch, scores.components)
    batch.set(outputs[0], torch.tensor(scores.total, dtype=torch.float32))
    batch.set(REWARD_FAILED, reward_failures(batch) | torch.tensor(scores.failed,
                                                                   dtype=torch.bool))


def _add_components(batch: Batch, components: dict[str, list[float]]) -> None:
    """Adds each sample's reward component scores to its `reward_components` dict.

    Several reward nodes (fan-in) add theirs to the same dicts, which `peerflow samples`
    shows beside the reward.
    """
    kept = batch[REWARD_COMPONENTS] if REWARD_COMPONENTS in batch else [{} for _ in
                                                                        range(len(batch))]
    merged = [dict(old) for old in kept]
    for name, scores in components.items():
        for row, score in zip(merged, scores):
            if not math.isnan(score):  # NaN: this reward did not score the sample
                row[name] = score
    batch.set_objects(REWARD_COMPONENTS, merged)


def _add_failures(batch: Batch, scores: Any) -> None:
    """Adds the names of the rewards that failed on each sample to its `reward_errors`."""
    position = {sid: i for i, sid in enumerate(batch.sample_id.tolist())}
    kept = batch[REWARD_ERRORS] if REWARD_ERRORS in batch else [[] for _ in range(len(batch))]
    merged = [list(names) for names in kept]
    for error in scores.errors:
        i = position[error.sample_id]
        if scores.failed[i] and error.reward not in merged[i]:
            merged[i].append(error.reward)
    batch.set_objects(REWARD_ERRORS, merged)


def _samples(batch: Batch) -> str:
    """Names a batch's samples for messages: ids and the first prompt."""
    ids = batch.sample_id.tolist()
    shown = ", ".join(map(str, ids[:8])) + (f", … ({len(ids)} in all)" if len(ids) > 8 else "")
    if not len(batch) or "example" not in batch:
        return f"sample_id {shown}"
    first = batch["example"][0]
    return (f"sample_id {shown}; first: {dataset_row(first)}, prompt "
            f"{str(getattr(first, 'prompt', ''))[:60]!r}")


def run_generate(ctx: NodeContext, batch: Batch) -> Batch:
    """Samples answers for this dp-rank's share of `run.prompts_per_step` prompts."""
    count = split_evenly(ctx.config.run.prompts_per_step, ctx.dp_size, ctx.dp_rank)
    draws = ctx.prompts.draw(count)
    sampling = _sampling(ctx, 0)
    bar = ctx.progress.generation(len(draws) * sampling.n) if ctx.progress is not None else (
        contextlib.nullcontext(lambda n=1: None))
    with bar as advance:
        out = ctx.generate(draws, sampling)
        advance(len(out))
    ctx.metrics.sum("rollout/prompts", len(draws))
    return out if not len(batch) else Batch.concat([batch, out])


def run_reward(ctx: NodeContext, batch: Batch) -> Batch:
    """Scores every answer; with `algorithm.dynamic_sampling`, refills flat groups (DAPO)."""
    _score(ctx, batch)
    if ctx.config.algorithm.dynamic_sampling and "reward" in batch:
        batch = _dynamic_sampling(ctx, batch)
    return batch


def _dynamic_sampling(ctx: NodeContext, batch: Batch) -> Batch:
    """Drops groups whose rewards are all equal and samples new prompts to refill (DAPO).

    A group the failure policies leave out (`rollout.agent.on_env_error`,
    `task.reward_limits.on_failure`: `_failure_exclusions`) counts as dropped too, and
    the others' rewards are compared over the samples the policies keep. Refill rounds
    are bounded by `ctx.max_refill_rounds`. When the bound is hit, the batch is topped up
    with flat groups so every dp-rank trains on the same number of groups (train engines
    step in lock-step); flat groups carry zero group-relative advantage.
    Works with one reward node (the one writing `reward`).
    """
    from peerflow.algorithms.dynamic_sampling import filter_groups, take_groups, top_up

    metrics = ctx.metrics
    target = group_count(batch)
    pool, everything = [batch], batch
    result = filter_groups(batch, target, excluded=_failure_exclusions(ctx, batch))
    first = result
    rounds = 0
    while result.refill_groups > 0 and rounds < ctx.max_refill_rounds:
        rounds += 1
        fresh = ctx.generate(ctx.prompts.draw(result.refill_groups), _sampling(ctx, rounds))
        _score(ctx, fresh)
        pool.append(fresh)
        everything = Batch.concat(pool)
        result = filter_groups(everything, target,
                               excluded=_failure_exclusions(ctx, everything))
    out = take_groups(result.batch, target)
    missing = target - group_count(out)
    chosen = set(out.group_id.tolist())
    flat = [i for i, g in enumerate(everything.group_id.tolist()) if g not in chosen]
    out = top_up(out, take_groups(everything.select(flat), max(missing, 0)))
    for name, value in first.metrics().items():
        if name.endswith("fraction"):
            metrics.mean(name, value, target)
        else:
            metrics.sum(name, value)
    metrics.sum("dynamic_sampling/refill_rounds", rounds)
    metrics.sum("dynamic_sampling/topped_up_groups", max(missing, 0))
    return out


def _failure_policies(ctx: NodeContext) -> tuple[str, str]:
    """`rollout.agent.on_env_error` (`train` without agents), `task.reward_limits.on_failure`."""
    agent = ctx.config.rollout.agent
    return (agent.on_env_error if agent is not None else "train",
            ctx.config.task.reward_limits.on_failure)


def _failure_exclusions(ctx: NodeContext, batch: Batch) -> torch.Tensor:  # [num_samples]
    """The samples the failure policies leave out (`failed_samples.failure_exclusions`)."""
    from peerflow.algorithms.failed_samples import failure_exclusions

    env_excluded, reward_excluded = failure_exclusions(batch, *_failure_policies(ctx))
    return env_excluded | reward_excluded


def run_ref_logprob(ctx: NodeContext, batch: Batch) -> Batch:
    """Adds `ref_logprobs`: the frozen reference model's log-prob of every answer token."""
    return batch.set("ref_logprobs", ctx.engine("ref").forward_logprobs(batch))


def run_old_logprob(ctx: NodeContext, batch: Batch) -> Batch:
    """Adds `old_logprobs`: the actor's log-probs before this step's update."""
    return batch.set("old_logprobs", ctx.engine("actor").forward_logprobs(batch))


def run_values(ctx: NodeContext, batch: Batch) -> Batch:
    """Adds `values`: the critic's per-token value estimates."""
    return batch.set("values", ctx.engine("critic").forward_values(batch))


def run_advantage(ctx: NodeContext, batch: Batch) -> Batch:
    """Runs the advantage estimator (after fan-in reward sums and any KL penalty).

    Several reward fields (fan-in) are summed into `reward`; with `kl.mode: reward` the
    KL penalty is subtracted first. Samples the environment or the reward failed are left
    out as `rollout.agent.on_env_error` and `task.reward_limits.on_failure` say
    (`peerflow.algorithms.failed_samples`): the estimator runs over the kept samples only.
    """
    node, metrics, algorithm = ctx.node, ctx.metrics, ctx.algorithm
    if "reward" not in batch:
        parts = [f for f in getattr(node, "inputs", ()) if f.endswith("reward")
                 and isinstance(batch.fields.get(f), torch.Tensor)]
        if not parts:
            raise RuntimeError(
                f"advantage node {getattr(node, 'name', 'advantage')!r} finds no `reward` "
                "field and no *reward input; connect a reward node to it."
            )
        batch.set("reward", torch.stack([batch[f] for f in parts]).sum(0))
    if algorithm.shapes_rewards:
        algorithm.shape_rewards(batch, metrics)
    from peerflow.algorithms.failed_samples import apply_failure_policies, estimate_advantages

    keep = apply_failure_policies(batch, *_failure_policies(ctx))
    record_reward_spread(batch, metrics)
    for name, column in estimate_advantages(algorithm.estimator, batch, keep).items():
        batch.set(name, column)
    kept = batch if bool(keep.all()) else batch.select(keep.nonzero().flatten())
    adv = kept.ragged("advantages").values.float()
    mask = kept.loss_mask()
    if mask is not None:  # observation tokens carry no advantage
        adv = adv[mask]
    if adv.numel():
        metrics.mean("advantages/mean", float(adv.mean()), adv.numel())
        metrics.mean("advantages/_sq", float((adv**2).mean()), adv.numel())
        metrics.max("advantages/max", float(adv.max()))
        metrics.min("advantages/min", float(adv.min()))
    return batch


def record_reward_spread(batch: Batch, metrics: StepMetrics) -> None:
    """`reward/frac_zero_std`: the share of samples whose group's rewards are all equal.

    Groups are whole at the advantage node; with `n` answers a prompt it is the share of
    groups with no reward spread, whose group-relative advantages are all 0 (no signal).
    """
    from peerflow.algorithms.ragged_ops import group_stats

    count, _, std = group_stats(batch["reward"], batch.group_id)
    grouped = count > 1
    if bool(grouped.any()):
        metrics.mean("reward/frac_zero_std", float((std[grouped] == 0).double().mean()),
                     int(grouped.sum()))


def run_train_actor(ctx: NodeContext, batch: Batch) -> Batch:
    """One `train_step` of the actor with the configured policy loss."""
    actor_batch = ctx.algorithm.prepare_actor_batch(batch, ctx.metrics)
    out = ctx.engine("actor").train_step(actor_batch, ctx.algorithm.policy_loss)
    ctx.metrics.add_engine_metrics("actor", out, max(len(actor_batch), 1))
    return batch


def run_train_critic(ctx: NodeContext, batch: Batch) -> Batch:
    """One `train_step` of the critic with the value loss (`train_mask` false: left out)."""
    from peerflow.algorithms.setup import trained_samples

    trained = trained_samples(batch)
    out = ctx.engine("critic").train_step(trained, ctx.algorithm.value_loss)
    ctx.metrics.add_engine_metrics("critic", out, max(len(trained), 1))
    return batch


def run_sync_weights(ctx: NodeContext, batch: Batch) -> Batch:
    """Moves the actor's new weights into the rollout engine (every `weight_sync.every`)."""
    if ctx.step % max(ctx.config.weight_sync.every, 1):
        return batch
    metrics = ctx.metrics
    start = time.perf_counter()
    stats = ctx.sync_weights()
    metrics.max("weight_sync/total_s", time.perf_counter() - start)
    for phase in ("plan_s", "gather_s", "pack_s", "wire_s", "load_s", "pause_s",
                  "sender_share"):
        if hasattr(stats, phase):
            metrics.max(f"weight_sync/{phase}", float(getattr(stats, phase)))
    for total in ("bytes", "wire_bytes", "changed_elements", "compared_elements", "full_sends"):
        if hasattr(stats, total):
            metrics.sum(f"weight_sync/{total}", float(getattr(stats, total)))
    return batch


#: What each built-in kind does (`peerflow.worker.nodes` registers them as node kinds).
BUILTIN_EXECUTORS: dict[str, Executor] = {
    "generate": run_generate,
    "reward": run_reward,
    "ref_logprob": run_ref_logprob,
    "old_logprob": run_old_logprob,
    "values": run_values,
    "advantage": run_advantage,
    "train_actor": run_train_actor,
    "train_critic": run_train_critic,
    "sync_weights": run_sync_weights,
}
