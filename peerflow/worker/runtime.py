"""`WorkerRuntime`: everything one worker process holds while it runs its program.

Built once per process by `peerflow.worker.main`: the resolved model directory, the
tokenizer, the task and its rewards, the algorithm (estimator, losses, reward shaping,
looked up through the plugin registries by `build_components`), this rank's engines (one
per role it hosts, built by `WorkerRuntime.build_engine`) and its prompt sampler. Nodes do
not see it: each runs with the narrow `NodeContext` that `node_context` builds.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import attrs

from peerflow.algorithms.base import Task
from peerflow.config import RunConfig, structure_options
from peerflow.engines import EngineContext
from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout
from peerflow.rewards import RewardSet, build_reward_set
from peerflow.rollout.generate import generate_batch
from peerflow.rollout.sampler import ShardedPromptSampler
from peerflow.worker.node_context import NodeContext
from peerflow.workflow.roles import ROLES


def resolve_model_path(config: RunConfig, pm: Any) -> str:
    """Returns the local model directory: `model.path`, or the one `model.builder` makes.

    Args:
        config: The run config.
        pm: The plugin manager (the builder is a registered task's `build_model`; the
            cache root is `$PEERFLOW_MODEL_CACHE` or the task's default). Call it on one
            process per machine first, then on the others after a barrier.

    Raises:
        ConfigError: neither `model.path` nor `model.builder` is set, or the path is
            not a directory.
    """
    model = config.model
    if model.path:
        path = Path(model.path).expanduser()
        if not path.is_dir():
            raise ConfigError(
                f"model.path={model.path!r} is not a directory; point it at a local Hugging "
                "Face model directory (config.json, weights, tokenizer)."
            )
        return str(path)
    if not model.builder:
        raise ConfigError(
            "model: set model.path to a local Hugging Face model directory, or "
            "model.builder to a task that builds a tiny model (e.g. reverse-digits)."
        )
    task_cls = pm.get("task", model.builder)
    cache = os.environ.get("PEERFLOW_MODEL_CACHE") or None
    return str(task_cls.build_model(dict(model.builder_options), cache))


def _options(cls: type, section: Any, key: str) -> Any:
    return structure_options(getattr(cls, "options_class", object), section, key)


@attrs.define(eq=False)
class WorkerRuntime:
    """State of one worker process: config, rank facts, components, engines, sampler."""

    config: RunConfig
    rank: int
    """Global rank."""
    world_size: int
    run_dir: Path
    """The run directory every rank writes into."""
    pm: Any
    """This process's `PluginManager`."""
    model_path: str
    """Local HF model directory the engines load."""
    tokenizer: Any
    task: Task
    rewards: dict[str, RewardSet]
    """Reward sets built so far, by a node's `options.reward` (`""`: the run's rewards)."""
    default_reward: str
    """The task's `default_reward` (used when the config names no reward)."""
    dp_rank: int
    """This rank's index among the prompt readers."""
    dp_size: int
    """Number of prompt readers (dp-ranks of the `generate` role)."""
    sampler: ShardedPromptSampler | None
    engines: dict[str, Any] = attrs.field(factory=dict)
    """This rank's engine for each hosted role (`rollout`, `actor`, `ref`, `critic`)."""
    layouts: dict[str, ParallelLayout] = attrs.field(factory=dict)
    algorithm: Any = None
    """The run's `peerflow.algorithms.Algorithm`: estimator, losses, reward shaping."""
    groups: dict[str, Any] = attrs.field(factory=dict)
    """The process group of each role this rank hosts (`RankProgram.process_group`)."""
    weight_sync: Any = None
    """The run's `WeightSyncService` on ranks that take part in weight syncs, else `None`."""
    max_refill_rounds: int = 4
    progress: Any = None
    """The step progress bar (`peerflow.outputs.StepProgress`); draws on rank 0 only."""
    step: int = 0
    agent: Any = None
    """The multi-turn driver (`peerflow.agents.rollout.AgentRollout`) when the config has
    `rollout.agent`, else `None` (single-turn answers)."""
    prompt_sharing: dict[str, bool] = attrs.field(factory=dict)
    """Role → whether its engines run a prompt once for all its samples, for every role
    of the run, hosted here or not (`program.roles_sharing_prompts`)."""

    def generate_batch(self, engine: Any, draws: Any, sampling: Any, **agent_args: Any) -> Any:
        """Samples a batch for `draws`: agent episodes with `rollout.agent`, else answers.

        Args:
            engine: The rollout engine (or the async loop's segmenting proxy).
            draws: Prompts drawn from the task.
            sampling: Sampling settings (`n` per prompt).
            **agent_args: `between` and `chunk_tokens` of `AgentRollout.__call__`
                (ignored by single-turn generation).
        """
        if self.agent is not None:
            return self.agent(engine, self.tokenizer, draws, sampling, **agent_args)
        return generate_batch(engine, self.tokenizer, draws, sampling)

    def engine(self, role: str) -> Any:
        """Returns this rank's engine for `role`.

        Raises:
            RuntimeError: the role is not hosted on this rank (a planner bug).
        """
        try:
            return self.engines[role]
        except KeyError:
            raise RuntimeError(
                f"rank {self.rank} runs a node of role {role!r} but hosts only "
                f"{sorted(self.engines)}; the per-rank program and placement disagree."
            ) from None

    def sync_weights(self) -> Any:
        """Runs one trainer → rollout weight sync (every rank of the sync, together).

        Returns:
            This rank's `WeightSyncStats`, or `None` on a rank outside the sync.
        """
        if self.weight_sync is None:
            return None
        actor = self.engines.get("actor")
        return self.weight_sync.sync(actor.version if actor is not None else self.step)

    def generating(self) -> Any:
        """Context around generation: the weight sync's sleep/wake time sharing, if any."""
        if self.weight_sync is None:
            return contextlib.nullcontext()
        return self.weight_sync.generating()

    def generate_on_rollout(self, draws: Any, sampling: Any) -> Any:
        """Samples a batch for `draws` on this rank's rollout engine, time-shared."""
        with self.generating():
            return self.generate_batch(self.engine("rollout"), draws, sampling)

    def node_context(self, node: Any, metrics: Any) -> NodeContext:
        """The `NodeContext` a node of this rank's program runs with."""
        return NodeContext(
            node=node, step=self.step, metrics=metrics, config=self.config,
            algorithm=self.algorithm, rank=self.rank, dp_rank=self.dp_rank,
            dp_size=self.dp_size, run_dir=self.run_dir, tokenizer=self.tokenizer,
            engine=self.engine, rewards=self.reward_set, process_group=self.groups.get,
            prompts=self.sampler, generate=self.generate_on_rollout,
            sync_weights=self.sync_weights, progress=self.progress,
            max_refill_rounds=self.max_refill_rounds)

    def reward_set(self, name: str | None = None) -> RewardSet:
        """Returns the rewards a reward node scores with (built once).

        `name` is a node's `options.reward` (one reward); `None` is the run's rewards
        (`task.reward` or `task.rewards`, else the task's own reward).
        """
        key = name or ""
        if key not in self.rewards:
            self.rewards[key] = build_reward_set(self.config.task, self.pm,
                                                 self.default_reward, name)
        return self.rewards[key]

    def context(self, role: str, process_group: Any = None, lora: Any = None) -> EngineContext:
        """Returns the `EngineContext` of this rank's engine for `role`.

        `lora` is `trainer.lora`, for an engine that trains or applies adapters. The
        rollout's dtype is `rollout.dtype` when set, every other role's `model.dtype`.
        """
        rollout = ROLES[role].engine == "rollout_engine"
        return EngineContext(
            lora=lora,
            model_path=self.model_path,
            layout=self.layouts[role],
            rank=self.rank,
            dtype=(rollout and self.config.rollout.dtype) or self.config.model.dtype,
            device=_device(),
            seed=self.config.seed,
            process_group=process_group,
            run_dir=str(self.run_dir),
            temperature=self.config.rollout.sampling.temperature,
            routed_experts=rollout and self.config.trainer.routing_replay == "r3",
        )

    def build_engine(self, role: str, process_group: Any = None) -> Any:
        """Builds the engine of one role from the registries and the config's options.

        What sets the role's engine apart (a value head, `trainer.lora`'s adapters or base
        view, MoE routing replay) is its entry in `peerflow.workflow.roles.ROLES`.
        """
        cfg, spec = self.config, ROLES[role]
        if spec.engine == "rollout_engine":
            cls = self.pm.get("rollout_engine", cfg.rollout.backend)
            options = _options(cls, cfg.rollout.engine_options.get(cfg.rollout.backend),
                               f"rollout.{cfg.rollout.backend}")
            return cls(self.context(role, process_group, cfg.trainer.lora), options)
        if spec.adapters == "base_view" and cfg.trainer.lora is not None:
            return _base_model_view(self.engines, role)
        cls = self.pm.get("train_engine", cfg.trainer.backend)
        section = dict(cfg.trainer.engine_options.get(cfg.trainer.backend) or {})
        if spec.value_head and attrs.has(cls.options_class) and "value_head" in (
                attrs.fields_dict(cls.options_class)):  # Capabilities.value_head: validated
            section["value_head"] = True
        options = _options(cls, section, f"trainer.{cfg.trainer.backend}")
        lora = cfg.trainer.lora if spec.adapters == "trains" else None
        optim = cfg.trainer.optim_settings(steps=cfg.run.steps)
        if not spec.routing_replay:
            optim = attrs.evolve(optim, routing_replay="off")
        return cls(self.context(role, process_group, lora), options, optim)


def _base_model_view(engines: dict[str, Any], role: str) -> Any:
    """A `base_view` role of a `trainer.lora` run: the actor with its adapters off."""
    from peerflow.training.lora import BaseModelView

    if "actor" not in engines:
        raise ConfigError(
            f"trainer.lora: role {role!r} is the actor's base with its adapters off, so it "
            f"must run on the actor's ranks; this rank hosts {role} without actor. Place "
            f"{role} with the actor (the default placement does)."
        )
    return BaseModelView(engines["actor"])


def _device() -> str:
    """This rank's engine device: the one `init_distributed` chose (the device contract)."""
    from peerflow.distributed.devices import rank_device
    from peerflow.distributed.init import dist_context

    ctx = dist_context()
    return str(ctx.device if ctx is not None else rank_device())


def build_task(config: RunConfig, pm: Any) -> Task:
    """The task `task.name` names, built from `task.options` (workers and `peerflow sft`)."""
    task_cls = pm.get("task", config.task.name)
    return task_cls(_options(task_cls, config.task.options, "task.options"))


def build_components(config: RunConfig, pm: Any,
                     statistics: tuple[Any, int] | None = None) -> dict[str, Any]:
    """Instantiates the task and the algorithm named by the config.

    Rewards are built on first use by `WorkerRuntime.reward_set`, on the ranks that score.

    Args:
        config: The run config.
        pm: The plugin manager.
        statistics: The advantage estimator's `(process_group, group_replicas)`: the
            group its batch-wide statistics reduce over (`None`: this rank's batch).
    """
    from peerflow.algorithms.setup import build_algorithm

    task = build_task(config, pm)
    group, replicas = statistics or (None, 1)
    algo = build_algorithm(config.algorithm, max_tokens=config.rollout.sampling.max_tokens,
                           plugin_manager=pm, process_group=group, group_replicas=replicas)
    return {"task": task, "rewards": {}, "default_reward": type(task).default_reward,
            "algorithm": algo}
