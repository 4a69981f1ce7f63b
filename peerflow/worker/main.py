"""`run_worker`: what every PeerFlow process runs (the launcher calls it once per rank).

Call sequence on every rank (no rank drives the others):

1. read the config and overrides, set one torch thread, start torch.distributed;
2. load plugins, validate the config, plan the run (`peerflow.planner.plan_run`) and take
   this rank's program;
3. build the model directory (one process per machine, the others wait), the task,
   reward, algorithm and the engines of the roles this rank hosts;
4. hand this rank's schedule (`LockstepSchedule` in sync mode, a streaming schedule in
   async mode) to the run driver (`peerflow.worker.driver.drive`), which resumes, runs
   the steps, writes metrics and traces, calls hooks and checkpoints.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
from pathlib import Path
from typing import Any

import torch

from peerflow.config import RunConfig, load_config, validate_config
from peerflow.rollout.prompts import load_tokenizer
from peerflow.rollout.sampler import ShardedPromptSampler
from peerflow.worker.driver import drive
from peerflow.worker.evaluation import EvalHook
from peerflow.worker.loop import LockstepSchedule
from peerflow.worker.program import RankProgram, program_from_plan, roles_sharing_prompts
from peerflow.worker.runtime import WorkerRuntime, build_components, resolve_model_path
from peerflow.workflow.roles import ROLES, engine_roles


def _dump_stacks_on_crash() -> None:
    """A native crash (an abort, a segfault) prints every thread's Python stack to stderr.

    Under `peerflow train` that is the launcher's terminal (workers inherit it): the
    stacks name the thread that was in a C++ call, which an exit code of -6 or -11 alone
    does not.
    """
    if not faulthandler.is_enabled():
        with contextlib.suppress(AttributeError, OSError, RuntimeError, ValueError):
            faulthandler.enable(all_threads=True)  # needs a stderr with a file descriptor


def _environment(config: RunConfig | None = None) -> None:
    from peerflow.outputs.progress import quiet_library_progress

    _dump_stacks_on_crash()
    quiet_library_progress()  # the step lines say it all: no per-worker library bars
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    threads = config.runtime.torch_threads if config is not None else 1
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)


def _choose_sandbox(config: RunConfig, pm: Any, rank: int) -> None:
    """Makes `config.sandbox` this worker's sandbox (and its reward pool's).

    A run on the weaker fallback says so at start.
    """
    from peerflow.rewards.model_code import fallback_notice
    from peerflow.sandbox import configure

    configure(config.sandbox)
    notice = fallback_notice(config, pm) if rank == 0 else None
    if notice:
        print(notice, file=sys.stderr, flush=True)


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _barrier(what: str = "barrier") -> None:
    import torch.distributed as dist

    from peerflow.distributed import barrier

    if dist.is_available() and dist.is_initialized():
        barrier(what=what)


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
    from peerflow.distributed.init import free_port

    config = load_config(config_path, overrides)
    _environment(config)
    run_path = Path(resume or run_dir)
    rank, world_size = _rank_and_world()
    _seed_everything(config.seed, rank)
    if "RANK" in os.environ:
        init_distributed(timeout=config.runtime.fault_timeout,
                         wait_timeout=config.runtime.peer_wait_timeout)
    else:  # one process started by hand (tests, notebooks)
        init_distributed(timeout=config.runtime.fault_timeout, rank=0, world_size=1,
                         wait_timeout=config.runtime.peer_wait_timeout,
                         init_method=f"tcp://127.0.0.1:{free_port()}")
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
    _choose_sandbox(config, pm, rank)
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
    components = build_components(config, pm, statistics=_advantage_group(program))
    tokenizer = load_tokenizer(model_path)
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
        model_path=model_path, tokenizer=tokenizer, dp_rank=dp_rank, dp_size=dp_size,
        sampler=sampler, layouts=dict(program.layouts), agent=_agent_rollout(config, pm),
        groups={role: program.process_group(role) for role in program.roles}, **components,
    )
    # a base-view role (the LoRA reference) views the actor: built after it
    for role in sorted(program.roles, key=lambda r: ROLES[r].adapters == "base_view"):
        if role in engine_roles():
            rt.engines[role] = rt.build_engine(role, program.process_group(role))
    rt.prompt_sharing = roles_sharing_prompts(rt.engines)
    if program.has_kind("sync_weights") or config.runtime.mode == "async":
        rt.weight_sync = _weight_sync(rt)
    return rt, program


def _advantage_group(program: RankProgram) -> tuple[Any, int] | None:
    """The group the advantage estimator's batch-wide statistics reduce over, and replicas.

    Batch-wide statistics (REINFORCE++ / GAE whitening) span every dp-shard; each dp-shard
    is held by `world_size / dp` ranks of the advantage node's role (its tp/pp/… peers).
    `None` on a rank that runs no advantage node.
    """
    advantage = next((n for n in program.steps if getattr(n, "kind", "") == "advantage"), None)
    layout = program.layouts.get(advantage.role) if advantage is not None else None
    if layout is None:
        return None
    return program.process_group(advantage.role), layout.world_size // layout.dp


def _agent_rollout(config: RunConfig, pm: Any) -> Any:
    from peerflow.agents.rollout import AgentRollout

    return AgentRollout.from_config(config, pm)


def _program(config: RunConfig, world_size: int, rank: int, pm: Any) -> RankProgram:
    from peerflow.planner import plan_run

    plan = plan_run(config, world_size, pm)
    return program_from_plan(plan, rank, mode=config.runtime.coordinator,
                             transport=config.runtime.coordinator_transport,
                             timeout=config.runtime.peer_wait_timeout)


def _weight_sync(rt: WorkerRuntime) -> Any:
    """Builds the run's `WeightSyncService` (collective over every rank taking part).

    Async mode's push runs the transport on background threads, so there it gets a
    process group of its own that carries nothing else.
    """
    from peerflow.distributed.groups import new_group
    from peerflow.reshard import WeightSyncService

    ws, runtime = rt.config.weight_sync, rt.config.runtime
    group = None
    if runtime.mode == "async":
        group = new_group(timeout=runtime.peer_wait_timeout)
    return WeightSyncService.build(
        rt.engines.get("actor"), rt.engines.get("rollout"), transport=ws.transport,
        bucket_bytes=ws.bucket_bytes, group=group, colocated=runtime.placement == "colocated",
        encoding=ws.encoding, full_every=ws.full_every)


def _train(rt: WorkerRuntime, program: RankProgram, stage: Any, *, resuming: bool) -> None:
    """Runs this rank's schedule under the run driver: lockstep (sync) or streaming (async).

    Held-out evaluation (`EvalHook`) is collective over every rank: the driver calls it on
    every rank of a lockstep run and on the trainer ranks of an async one, whose rollout
    ranks call it from their streaming schedule.
    """
    evaluation = EvalHook(stage=stage)
    if rt.config.runtime.mode == "async":
        from peerflow.worker.async_schedule import streaming_schedule

        schedule = streaming_schedule(rt, program, stage, evaluation=evaluation)
    else:
        schedule = LockstepSchedule(rt=rt, program=program, stage=stage)
    drive(rt, schedule, stage, resuming=resuming, hooks=[evaluation])


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
