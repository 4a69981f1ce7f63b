"""The run configuration: one attrs class per YAML section."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from peerflow.config.engines import RolloutConfig, TrainerConfig, WeightSyncConfig
from peerflow.config.tracking import TrackersConfig
from peerflow.config.workflow import WorkflowConfig
from peerflow.sandbox.config import SandboxConfig


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The policy model: a local Hugging Face directory, or one a task plugin builds."""

    path: str | None = None
    """Local HF model directory (config, safetensors, tokenizer)."""
    builder: str | None = None
    """Name of a registered task's tiny-model builder, used when `path` is empty; the
    built model and tokenizer are cached on disk."""
    builder_options: dict[str, Any] = attrs.field(factory=dict)
    """Options for the builder (hidden size, layers, …)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""

    def model_type(self) -> str | None:
        """The policy's HF `model_type`: `path`'s config.json, else `builder_options`.

        `None` when neither says (a builder's default family, or no config.json yet).
        """
        from peerflow.models.config import model_type_at

        return model_type_at(self.path) if self.path else self.builder_options.get("model_type")


@attrs.frozen(kw_only=True)
class RewardEntry:
    """One reward of `task.rewards`: a function and its weight in the total."""

    fn: str
    """A registered reward name, `path/to/rewards.py:function` or `package.module:function`."""
    weight: float = 1.0
    """Weight of this reward in the summed `reward`."""
    name: str | None = None
    """Name of its metrics (`reward/<name>/mean`); default: the function's name."""
    batched: bool | None = None
    """Call a function reward once per batch (`fn(responses, examples)`); `None` decides by
    its first parameter's name (`responses`, `completions`, … mean batched)."""


@attrs.frozen(kw_only=True)
class RewardLimits:
    """How function rewards run: a pool of worker processes with per-call limits."""

    workers: int = 2
    """Reward worker processes per rank that scores (0: call in the rank's own process,
    without time or memory limits — for debugging)."""
    timeout_s: float = 30.0
    """Wall-clock limit of one call (one sample, or one batched call); the worker running
    a call past it is killed and the samples are scored `failure_score`."""
    memory_mb: int = 4096
    """Address-space limit of each reward worker (`RLIMIT_AS`; 0: none)."""
    failure_score: float = 0.0
    """Score of a sample whose reward raised, timed out or returned a non-number (each one
    is counted in `reward/errors` or `reward/timeouts` and logged with the sample)."""
    on_failure: Literal["train", "mask", "drop_group"] = "train"
    """What training does with such a sample: `train` it at `failure_score`; `mask`: leave
    it alone out (its group's baseline over the others); `drop_group`: leave its whole
    group out. Left-out groups are refilled under `algorithm.dynamic_sampling` (see
    `peerflow.algorithms.failed_samples`, the same policies as `rollout.agent.on_env_error`)."""
    fatal_after_steps: int = 3
    """Stop the run when one reward fails on every sample it scores for this many steps in
    a row, naming the reward, a sample and its traceback (0: never stop)."""
    max_failure_share: float = 0.5
    """The run exits non-zero (after its last checkpoint) when more than this share of its
    trained samples had a reward fail on them (raise, time-out, NaN or a non-number);
    1: never. The end-of-run tally is printed and written to `reward_errors.json`."""


@attrs.frozen(kw_only=True)
class TaskConfig:
    """Where prompts come from and how answers are scored."""

    name: str = "reverse-digits"
    """Registered task (see `peerflow plugins`), or `dataset` for a local file."""
    options: dict[str, Any] = attrs.field(factory=dict)
    """The task's own options, validated by the task's options class."""
    reward: str | None = None
    """Registered reward name, `path/to/rewards.py:function` or `package.module:function`;
    defaults to the task's own reward."""
    rewards: list[RewardEntry] = attrs.field(factory=list)
    """Several weighted rewards (instead of `reward`); `reward` is their weighted sum."""
    reward_limits: RewardLimits = attrs.Factory(RewardLimits)
    """Time and memory limits of function rewards."""

    def __attrs_post_init__(self) -> None:
        if self.reward and self.rewards:
            raise ValueError("set task.reward (one reward) or task.rewards (a weighted list), "
                             "not both.")


@attrs.frozen(kw_only=True)
class EvalConfig:
    """Held-out evaluation: `run.eval_every`, and `peerflow eval`."""

    split: str = "eval"
    """The task's split to score."""
    max_prompts: int = 64
    """Prompts evaluated (the split's first ones; 0: all)."""
    greedy: bool = True
    """Score one greedy answer per prompt (`eval/greedy/*`)."""
    n: int = 0
    """Sampled answers per prompt at `rollout.sampling.temperature` (`eval/sampled/*` and
    `eval/pass@k` for k = 1, 2, 4, … ≤ n); 0: none."""
    correct_threshold: float = 1.0
    """A sampled answer counts as correct for pass@k when its reward reaches this."""


@attrs.frozen(kw_only=True)
class KLConfig:
    """KL regularisation towards a frozen reference model (see docs/algorithms.md)."""

    coef: float = 0.0
    """KL coefficient; 0 disables the reference model entirely."""
    estimator: Literal["k1", "k2", "k3"] | None = None
    """Per-token KL estimator (Schulman's k1/k2/k3); `None` picks `k1` in `reward` mode
    (its score-function gradient is the KL gradient) and `k3` in `loss` mode (GRPO's
    choice; its gradient as a loss is that of KL(reference || policy)). `k2` is the one
    whose gradient as a loss is that of KL(policy || reference); `k1` as a loss has zero
    expected gradient (a warning says so)."""
    mode: Literal["loss", "reward"] = "loss"
    """Add KL to the loss, or subtract it from the reward (per token for the token-level
    estimators `gae` and `reinforce_pp`, summed into the sample's reward otherwise)."""

    @property
    def resolved_estimator(self) -> str:
        """The estimator in use: `estimator`, else the mode's default."""
        return self.estimator or ("k1" if self.mode == "reward" else "k3")


@attrs.frozen(kw_only=True)
class OffPolicyConfig:
    """Correction for samples drawn by another policy than the trainer's (decoupled PPO).

    The behaviour policy is the rollout engine's (`rollout_logprobs`), the proximal policy
    the trainer's recomputed log-probs before the update (`old_logprobs`); each token's
    loss is multiplied by `w = exp(old_logprobs - rollout_logprobs)`, truncated or masked.
    Stale samples (async mode, `weight_sync.every > 1`) are refused without it.
    """

    correction: Literal["tis", "mis", "none"] = "tis"
    """`tis`: truncated importance sampling, `min(w, cap)` (verl's token-level TIS);
    `mis`: masked importance sampling, `w` where `lower <= w <= cap`, else 0 (AReaL's
    `behav_imp_weight_cap`, verl's IcePop); `none`: no correction (on-policy runs only)."""
    cap: float = attrs.field(default=2.0)
    """Upper bound on the weight (2.0, verl's default `rollout_is_threshold`)."""
    lower: float = attrs.field(default=0.0)
    """`mis` only: tokens whose weight is below this are masked too (0: none)."""

    def __attrs_post_init__(self) -> None:
        if not self.cap > 1.0:
            raise ValueError(
                f"cap={self.cap}: must be > 1 (a cap at or below 1 would shrink the weight of "
                "on-policy tokens, whose weight is 1); verl's and the default is 2.0."
            )
        if not 0.0 <= self.lower < 1.0:
            raise ValueError(f"lower={self.lower}: must lie in [0, 1) (0: no lower mask).")


@attrs.frozen(kw_only=True)
class OverlongConfig:
    """DAPO's handling of answers that reach (or nearly reach) `max_tokens`."""

    buffer: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Soft overlong punishment: an answer longer than `max_tokens - buffer` tokens loses
    `penalty * (length - (max_tokens - buffer)) / buffer` reward (0 disables)."""
    penalty: float = attrs.field(default=1.0, validator=attrs.validators.ge(0.0))
    """Largest reward lost to the soft punishment (at `max_tokens`)."""
    filter: bool = False
    """Overlong filtering: truncated answers (`finish_reason` `length`; agent trajectories
    cut off at `max_tokens` / `max_turns`) get no loss."""


@attrs.frozen(kw_only=True)
class AlgorithmConfig:
    """Advantage estimation and policy loss."""

    advantage: str = "grpo"
    """Registered advantage estimator (grpo, gae, rloo, reinforce_pp, …)."""
    loss: str = "ppo_clip"
    """Registered policy loss (ppo_clip, gspo, …)."""
    options: dict[str, Any] = attrs.field(factory=dict)
    """Options of the selected estimator and loss, keyed by their names."""
    kl: KLConfig = attrs.Factory(KLConfig)
    """KL to the reference model."""
    off_policy: OffPolicyConfig = attrs.Factory(OffPolicyConfig)
    """Importance weights for stale or mismatched samples (on by default)."""
    entropy_coef: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    """Entropy bonus: the loss subtracts `entropy_coef * aggregate(entropy)` (0: off)."""
    overlong: OverlongConfig = attrs.Factory(OverlongConfig)
    """DAPO's overlong reward shaping and filtering (off by default)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and refill the batch."""
    turn_rewards: Literal["sum", "ignore"] = "sum"
    """Multi-turn trajectories' per-turn rewards (the batch field `token_rewards`, each at
    its turn's last model token) for estimators that read only the outcome `reward`
    (grpo, rloo): `sum` adds each trajectory's summed per-turn rewards to its `reward`
    before the estimator; `ignore` trains on the outcome alone. Token-level estimators
    (gae, reinforce_pp) always read them per token."""


@attrs.frozen(kw_only=True)
class RunSettings:
    """Length of the run and what it writes."""

    steps: int = 60
    """Training steps."""
    prompts_per_step: int = 32
    """Prompts sampled per step across all dp-ranks (each gets `sampling.n` answers)."""
    checkpoint_every: int = 0
    """Save a checkpoint every K steps (0: only at the end)."""
    keep_last: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Keep only the newest K verified checkpoints, removing older ones (0: keep all)."""
    log_every: int = 1
    """Write metrics every K steps."""
    tensorboard: bool = True
    """Write TensorBoard events."""
    wandb: bool = False
    """Log to Weights & Biases (project, entity, name, tags, group: `run.trackers.wandb`)."""
    mlflow: bool = False
    """Log to MLflow (tracking URI, experiment, run name, tags: `run.trackers.mlflow`)."""
    trackers: TrackersConfig = attrs.Factory(TrackersConfig)
    """Options of the W&B and MLflow trackers (`peerflow.config.tracking`)."""
    trace: bool = True
    """Write a per-rank Chrome-trace timeline."""
    eval_every: int = 0
    """Score the held-out split (see `eval`) every K steps, before the first step and at
    the end (0: never)."""
    samples_per_step: int = attrs.field(default=8, validator=attrs.validators.ge(0))
    """Write this many samples of every step (the first by `sample_id`: prompt, response,
    reward and its components, advantage) to `RUN_DIR/samples/step_N.jsonl`, read by
    `peerflow samples` (0: none)."""


#: How long a rank waits for a live peer when some stage has no deadline (one day).
NO_DEADLINE_WAIT_S = 86_400.0


@attrs.frozen(kw_only=True)
class RuntimeConfig:
    """How the workflow runs across processes."""

    nprocs: int = 2
    """Worker processes on this machine (`peerflow train --nprocs` overrides)."""
    mode: Literal["sync", "async"] = "sync"
    """`sync`: multi-controller steps; `async`: streaming with bounded staleness."""
    placement: Literal["colocated", "split"] = "colocated"
    """`colocated`: every role on every rank; `split`: disjoint rank sets per role."""
    coordinator: Literal["p2p", "centralized"] = "p2p"
    """Data routing; `centralized` is the single-controller baseline for benchmarks."""
    coordinator_transport: Literal["auto", "gloo", "shm"] = "auto"
    """How routes move bytes: `shm` (shared memory, every rank of a route on this host),
    `gloo`, or `auto` (`shm` where a route's ranks share a host, else `gloo`)."""
    balance_samples: bool = True
    """Sync mode: after the `advantage` node, balance samples (not whole prompt groups) by
    token count over the trainer's dp-ranks, so no rank waits for a busier one in the
    training step's collectives. Loss normalisers are global, so the step is the same."""
    fault_timeout: float = 60.0
    """Seconds before a rank gives up on a dead peer and exits naming it (a live peer busy
    in a long stage is waited for: `peer_wait_timeout`)."""
    stage_timeout: float = 1800.0
    """Seconds any one stage of a step (a node, a route, a weight sync, a checkpoint) may
    run on a rank before the run fails naming that rank and stage (0: no deadline)."""
    reward_timeout: float = 600.0
    """Seconds a reward node may run on a rank (the outer bound around per-call reward
    limits) before the run fails naming the rank, the reward and its samples (0: none)."""
    max_staleness: int = 1
    """Async mode: most weight versions a sample may lag the trainer by."""
    partial_rollout: bool = False
    """Async mode: apply new weights mid-request on engines that can pause."""
    partial_rollout_tokens: int = 0
    """Async mode with `partial_rollout`: tokens generated before new weights may take over
    a request (0: a quarter of `rollout.sampling.max_tokens`)."""
    sampler: str = "grouped"
    """Async mode: how a trainer forms micro-batches from streamed samples (`sequential`,
    `grouped`, `length_balanced`, or one a plugin registers with
    `peerflow_register_samplers`)."""
    async_prompts_per_call: int = 0
    """Async mode: most prompts a rollout rank starts in one generate call (0: its share of
    `run.prompts_per_step`); smaller calls stream finished groups sooner."""
    torch_threads: int = 1
    """torch intra-op threads per worker process."""
    stop_grace: float = attrs.field(default=10.0, validator=attrs.validators.ge(0))
    """Seconds a graceful stop (first Ctrl-C or SIGTERM) may take: every rank stops at the
    next step boundary, checkpointing it when cheap; past this, or on a second Ctrl-C,
    every rank stops at once."""
    stop_checkpoint: bool = True
    """Checkpoint the step a graceful stop ends at, when cheap: the run's slowest
    checkpoint save so far (none yet counts as cheap) took at most half of `stop_grace`."""

    @property
    def peer_wait_timeout(self) -> float:
        """Seconds a rank waits for a live peer in a collective, route or stream message.

        A peer may spend up to its longest stage deadline (`stage_timeout`,
        `reward_timeout`) in one stage — a long generation on a straggler — before it
        answers; past that, its own monitor fails the run naming it, and the record
        reaches every rank within `fault_timeout`. A dead peer is noticed far sooner, by
        the fault monitor's heartbeats and the launcher (`fault_timeout`), whatever this
        bound. With a stage without deadline (0), a live peer is waited for a day.
        """
        deadlines = (self.stage_timeout, self.reward_timeout)
        longest = max(deadlines) if min(deadlines) > 0 else NO_DEADLINE_WAIT_S
        return longest + self.fault_timeout

    def stage_deadline(self, kind: str) -> float | None:
        """Seconds a stage running a node of `kind` may take (`None`: no deadline)."""
        seconds = self.reward_timeout if kind == "reward" else self.stage_timeout
        return seconds if seconds > 0 else None


@attrs.frozen(kw_only=True)
class RunConfig:
    """A whole run: what `examples/quickstart.yaml` describes."""

    seed: int = 0
    """Base random seed (every rank derives its own streams)."""
    model: ModelConfig = attrs.Factory(ModelConfig)
    task: TaskConfig = attrs.Factory(TaskConfig)
    algorithm: AlgorithmConfig = attrs.Factory(AlgorithmConfig)
    rollout: RolloutConfig = attrs.Factory(RolloutConfig)
    trainer: TrainerConfig = attrs.Factory(TrainerConfig)
    weight_sync: WeightSyncConfig = attrs.Factory(WeightSyncConfig)
    workflow: WorkflowConfig = attrs.Factory(WorkflowConfig)
    """The workflow graph: `{graph: grpo|ppo}` or `{nodes: [...]}` (`peerflow.workflow`)."""
    runtime: RuntimeConfig = attrs.Factory(RuntimeConfig)
    run: RunSettings = attrs.Factory(RunSettings)
    eval: EvalConfig = attrs.Factory(EvalConfig)
    """What `run.eval_every` and `peerflow eval` score."""
    sandbox: SandboxConfig = attrs.Factory(SandboxConfig)
    """Where model-written code runs (the `code` reward, agent tools)."""
