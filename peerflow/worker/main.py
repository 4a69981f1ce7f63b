"""`run_worker`: what every PeerFlow process runs (the launcher calls it once per rank).

Call sequence on every rank (no rank drives the others):

1. read the config and overrides, set one torch thread, start torch.distributed;
2. load plugins, validate the config, plan the run (`peerflow.planner.plan_run`) and take
   this rank's program;
3. build the model directory (one process per machine, the others wait), the task,
   reward, algorithm and the engines of the roles this rank hosts;
4. restore the newest checkpoint when resuming;
5. run step after step: the program's nodes in order, metrics reduced across ranks
   (rank 0 appends them to `metrics.jsonl`), checkpoints every `run.checkpoint_every`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from peerflow.checkpoint import (
    list_checkpoints,
    restore_latest,
    save_step,
    should_checkpoint,
    truncate_metrics,
)
from peerflow.config import RunConfig, load_config, validate_config
from peerflow.errors import ConfigError
from peerflow.worker.evaluation import eval_due, evaluate
from peerflow.worker.loop import run_step
from peerflow.worker.program import RankProgram, program_from_plan
from peerflow.worker.runtime import TRAIN_ROLES, WorkerRuntime, build_components, resolve_model_path
from peerflow.worker.sampler import ShardedPromptSampler

#: Roles whose engines are the rollout engine; `reward` needs none.
ROLLOUT_ROLES = ("rollout",)


def _environment(config: RunConfig | None = None) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    threads = config.runtime.torch_threads if config is not None else 1
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _barrier(what: str = "barrier") -> None:
    import torch.distributed as dist

    from peerflow.distributed import barrier

    if dist.is_available() and dist.is_initialized():
        barrier(what=what)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _seed_everything(seed: int, rank: int) -> None:
    import random

    random.seed(seed * 1_000_003 + rank)
    torch.manual_seed(seed * 1_000_003 + rank)


def run_worker(
    config_path: str, overrides: list[str], run_dir: str, resume: str | None = None,
    *, body: Any = None,
) -> None:
    """Runs one worker process of a training run to completion.

    Args:
        config_path: The run's YAML config.
        overrides: `--set key=value` assignments applied on top of it.
        run_dir: The run directory (shared by all ranks; created by the launcher).
        resume: A run directory to continue from its newest complete checkpoint (the run
            then writes into that directory).
        body: `f(runtime, program, stage)` run instead of training (`peerflow eval`).

    Raises:
        ConfigError: the config, a name in it, or the resume directory is invalid.
        WorkerFailedError: a peer died or raised (naming its rank, host and stage).
    """
    from peerflow.distributed import init_distributed, shutdown_distributed, stage

    config = load_config(config_path, overrides)
    _environment(config)
    run_path = Path(resume or run_dir)
    rank, world_size = _rank_and_world()
    _seed_everything(config.seed, rank)
    if "RANK" in os.environ:
        init_distributed(timeout=config.runtime.fault_timeout)
    else:  # one process started by hand (tests, notebooks)
        init_distributed(timeout=config.runtime.fault_timeout, rank=0, world_size=1,
                         init_method=f"tcp://127.0.0.1:{_free_port()}")
    runtime = None
    try:
        with stage("start-up"):
            runtime, program = _start(config, run_path, rank, world_size, resume)
        if body is not None:
            body(runtime, program, stage)
        else:
            _train(runtime, program, stage, resuming=resume is not None)
    finally:
        if runtime is not None:
            for engine in runtime.engines.values():
                with contextlib.suppress(Exception):
                    engine.shutdown()
            for rewards in runtime.rewards.values():  # a live pool would block the exit
                rewards.close()
        shutdown_distributed()


def _start(
    config: RunConfig, run_path: Path, rank: int, world_size: int, resume: str | None
) -> tuple[WorkerRuntime, Any]:
    from peerflow.plugins import load_plugins

    pm = load_plugins()
    validate_config(config, pm)
    program = _program(config, world_size, rank, pm)
    if rank == 0:
        from peerflow.outputs import write_resolved_config

        run_path.mkdir(parents=True, exist_ok=True)
        write_resolved_config(run_path, config)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if local_rank == 0:
        model_path = resolve_model_path(config, pm)
    _barrier()
    if local_rank != 0:
        model_path = resolve_model_path(config, pm)
    components = build_components(config, pm)
    tokenizer = _load_tokenizer(model_path)
    data_layout = program.data_layout
    if rank in data_layout.global_ranks:
        dp_rank, dp_size = data_layout.dp_rank(rank), data_layout.dp
    else:  # this rank reads no prompts (split placement, trainer-only rank)
        dp_rank, dp_size = 0, 1
    task = components["task"]
    sampler = ShardedPromptSampler(
        examples=lambda: task.examples("train", config.seed),
        dp_rank=dp_rank, dp_size=dp_size, seed=config.seed,
        size=task.size("train"),
        lookup=lambda i: task.example("train", i, config.seed),
    )
    rt = WorkerRuntime(
        config=config, rank=rank, world_size=world_size, run_dir=run_path, pm=pm,
        model_path=model_path, tokenizer=tokenizer, task=task,
        rewards=components["rewards"], default_reward=components["default_reward"],
        estimator=components["estimator"], policy_loss=components["policy_loss"],
        value_loss=components["value_loss"], dp_rank=dp_rank, dp_size=dp_size,
        sampler=sampler, kl_reward=components["kl_reward"], algorithm=components["algorithm"],
        layouts=dict(program.layouts),
    )
    for role in program.roles:
        if role in ROLLOUT_ROLES or role in TRAIN_ROLES:
            rt.engines[role] = rt.build_engine(role, program.process_group(role))
    syncs = any(getattr(n, "kind", "") == "sync_weights" for n in program.steps)
    if syncs and config.runtime.mode != "async":  # async builds its own, on its own group
        rt.weight_sync = _weight_sync(rt)
    advantage = next((n for n in program.steps if getattr(n, "kind", "") == "advantage"), None)
    layout = program.layouts.get(advantage.role) if advantage is not None else None
    if layout is not None and rt.estimator is not None:
        # batch-wide statistics (REINFORCE++ / GAE whitening) span every dp-shard; each
        # dp-shard is held by world_size / dp ranks of the role (its tp/pp/... peers)
        rt.estimator.process_group = program.process_group(advantage.role)
        rt.estimator.group_replicas = layout.world_size // layout.dp
    return rt, program


def _program(config: RunConfig, world_size: int, rank: int, pm: Any) -> RankProgram:
    from peerflow.planner import plan_run

    plan = plan_run(config, world_size, pm)
    return program_from_plan(plan, rank, mode=config.runtime.coordinator,
                             timeout=config.runtime.fault_timeout)


def _load_tokenizer(model_path: str) -> Any:
    from peerflow.launch.preflight import load_tokenizer

    return load_tokenizer(model_path)


def _weight_sync(rt: WorkerRuntime, group: Any = None) -> Any:
    """Builds the run's `WeightSyncService` (collective over every rank taking part)."""
    from peerflow.reshard import WeightSyncService

    ws = rt.config.weight_sync
    return WeightSyncService.build(
        rt.engines.get("actor"), rt.engines.get("rollout"), transport=ws.transport,
        bucket_bytes=ws.bucket_bytes, group=group,
        colocated=rt.config.runtime.placement == "colocated")


def _train(rt: WorkerRuntime, program: RankProgram, stage: Any, *, resuming: bool = False
           ) -> None:
    from peerflow.outputs import MetricsWriter, StepProgress, Tracer, set_tracer

    if rt.config.runtime.mode == "async":  # streaming with bounded staleness
        from peerflow.worker.async_loop import run_async

        return run_async(rt, program, stage)
    config = rt.config
    start_step = 0
    if resuming:
        with stage("resume"):
            start_step = _restore(rt, program)
    elif list_checkpoints(rt.run_dir):
        raise ConfigError(
            f"run directory {str(rt.run_dir)!r} already holds checkpoints; continue it with "
            f"`peerflow train --resume {rt.run_dir}`, or pick another --run-dir."
        )
    writer = None
    if rt.rank == 0:
        if start_step:
            truncate_metrics(rt.run_dir / "metrics.jsonl", start_step)
        writer = MetricsWriter(rt.run_dir, config, tensorboard=config.run.tensorboard,
                               wandb=config.run.wandb)
    tracer = Tracer(rt.run_dir, rt.rank, enabled=config.run.trace)
    set_tracer(tracer)
    progress = StepProgress(config.run.steps, start=start_step, enabled=rt.rank == 0)
    rt.progress = progress
    registry = rt.pm.registry("node")
    node_types = {name: registry.get(name) for name in registry.names()}
    try:
        if start_step == 0 and eval_due(config, 0):
            metrics = _evaluate(rt, 0, stage)
            if writer is not None:
                writer.write(0, metrics)
        for step in range(start_step + 1, config.run.steps + 1):
            rt.step = step
            _, metrics = run_step(rt, program.steps, node_types=node_types,
                                  stage_factory=stage, tracer=tracer)
            evaluated = eval_due(config, step)
            if evaluated:
                metrics.update(_evaluate(rt, step, stage))
            if writer is not None and (step % max(config.run.log_every, 1) == 0
                                       or step == config.run.steps or evaluated):
                writer.write(step, metrics)
            progress.update(step, metrics)
            rt.pm.hook.peerflow_end_of_step(step=step, metrics=metrics, rank=rt.rank)
            if should_checkpoint(step, config.run.checkpoint_every, config.run.steps):
                with stage(f"checkpoint step {step}",
                           config.runtime.stage_deadline("checkpoint")), tracer.span("checkpoint"):
                    save_step(rt.run_dir, step, engines=rt.engines, rank=rt.rank,
                              driver_state={"sampler": rt.sampler.state_dict()},
                              keep_last=config.run.keep_last)
    finally:
        progress.close()
        tracer.flush()
        set_tracer(None)
        if writer is not None:
            writer.close()


def _evaluate(rt: WorkerRuntime, step: int, stage: Any) -> dict[str, float]:
    with stage(f"eval after step {step}"):
        return evaluate(rt, step)


def run_eval_worker(config_path: str, overrides: list[str], run_dir: str,
                    checkpoint: str | None = None) -> None:
    """The worker function of `peerflow eval`: builds the run, loads `checkpoint`, evaluates.

    Args:
        config_path: The run's YAML config.
        overrides: `--set` assignments.
        run_dir: Where `config.yaml` and `eval.json` are written.
        checkpoint: A checkpoint directory, or a run directory (its newest complete
            checkpoint); `None` evaluates the model at `model.path` / `model.builder`.
    """
    from peerflow.worker.evaluation import evaluate_checkpoint

    run_worker(config_path, overrides, run_dir, None,
               body=lambda rt, program, stage: evaluate_checkpoint(rt, program, stage,
                                                                  checkpoint))


def _restore(rt: WorkerRuntime, program: RankProgram) -> int:
    resumed = restore_latest(rt.run_dir, engines=rt.engines, rank=rt.rank)
    if resumed is None:
        raise ConfigError(
            f"--resume {str(rt.run_dir)!r}: no verified checkpoint under "
            f"{rt.run_dir / 'checkpoints'}; a run saves one every run.checkpoint_every steps "
            "and at its end. Start a fresh run instead, or pick another run directory."
        )
    if resumed.driver_state is not None:
        rt.sampler.load_state_dict(resumed.driver_state["sampler"])
    if any(getattr(n, "kind", "") == "sync_weights" for n in program.steps):
        rt.sync_weights()
    rt.step = resumed.step
    return resumed.step
