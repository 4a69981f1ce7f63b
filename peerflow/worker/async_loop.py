"""`runtime.mode: async`: wires the streaming pieces into the rollout and trainer programs.

Requires `runtime.placement: split` (rollout and trainer on disjoint ranks). Every rank:

1. builds the run's `WeightSyncService` once (a collective over all ranks), with its
   transport on a process group of its own, which the streaming push drives;
2. rollout ranks run `RolloutStreamer` (generate + per-group nodes such as reward and
   GRPO advantages), trainer ranks run `TrainerStreamer` (micro-batch forwards, training,
   asynchronous weight push); they meet only through p2p messages;
3. the first trainer rank writes `metrics.jsonl` (trainer metrics reduced over the
   trainer group, plus what the rollout ranks report with every sealed step); every rank
   writes its Chrome-trace timeline under `trace/`.

Checkpoints (`peerflow.checkpoint.save_step` on the trainer ranks, every
`run.checkpoint_every` steps and at the end) hold every trainable role's engine state plus
the in-flight state (`peerflow.checkpoint.inflight`): which prompt groups each rollout rank
has had trained. On resume a rollout rank replays its prompt stream up to the last
trained prompt and re-generates the ones that were in flight, so no prompt is lost and no
sample is trained twice.
"""

from __future__ import annotations

import time
from typing import Any

from peerflow.checkpoint import restore_latest, save_step, should_checkpoint, truncate_metrics
from peerflow.checkpoint.inflight import replay_prompts, trained_groups, trained_groups_state
from peerflow.errors import ConfigError
from peerflow.worker.metrics import StepMetrics, all_reduce_metrics
from peerflow.worker.runtime import WorkerRuntime

#: Node kinds a rollout rank runs on each finished group.
ROLLOUT_KINDS = ("reward",)
#: Node kinds a trainer runs per micro-batch (forwards of the frozen or current policy).
MICRO_BATCH_KINDS = ("ref_logprob", "old_logprob", "values")
#: Node kinds replaced by the asynchronous push.
SKIPPED_KINDS = ("generate", "sync_weights")


def check_async_config(config: Any, layouts: dict[str, Any]) -> None:
    """Raises `ConfigError` for settings async mode cannot run."""
    from peerflow.streaming.samplers import get_sampler

    rt = config.runtime
    if rt.placement != "split":
        raise ConfigError(
            f"runtime.mode=async needs runtime.placement=split (got {rt.placement!r}): "
            "rollout and trainer must run on disjoint ranks; set runtime.placement: split."
        )
    if rt.max_staleness < 0:
        raise ConfigError(f"runtime.max_staleness={rt.max_staleness}: must be 0 or more.")
    if config.algorithm.dynamic_sampling:
        raise ConfigError(
            "algorithm.dynamic_sampling refills whole steps and is not supported with "
            "runtime.mode=async yet; set it to false or use mode: sync."
        )
    rollout = layouts["rollout"]
    if rollout.tp * rollout.pp * rollout.ep > 1:
        raise ConfigError(
            f"runtime.mode=async runs each rollout rank as its own replica, but "
            f"rollout.layout is {rollout.describe()}; use tp=pp=1 per rank (an engine that "
            "drives its own tensor-parallel workers, e.g. vLLM, counts as one rank)."
        )
    get_sampler(rt.sampler)


def _graph_nodes(rt: WorkerRuntime) -> tuple[list[Any], dict[str, Any]]:
    from peerflow.planner import plan_run

    plan = plan_run(rt.config, rt.world_size, rt.pm)
    return [plan.graph.node(name) for name in plan.graph.order()], plan.roles


def _writer(rt: WorkerRuntime, start_step: int) -> Any:
    from peerflow.outputs import MetricsWriter

    if start_step:
        truncate_metrics(rt.run_dir / "metrics.jsonl", start_step)
    run = rt.config.run
    return MetricsWriter(rt.run_dir, rt.config, tensorboard=run.tensorboard, wandb=run.wandb)


def _tracer(rt: WorkerRuntime) -> Any:
    from peerflow.outputs import Tracer, set_tracer

    tracer = Tracer(rt.run_dir, rt.rank, enabled=rt.config.run.trace)
    set_tracer(tracer)
    return tracer


def run_async(rt: WorkerRuntime, program: Any, stage: Any) -> None:
    """Runs this rank's part of an async run (called by `run_worker` on every rank)."""
    nodes, layouts = _graph_nodes(rt)
    check_async_config(rt.config, layouts)
    rollout_layout, trainer_layout = layouts["rollout"], layouts["actor"]
    if set(rollout_layout.global_ranks) & set(trainer_layout.global_ranks):
        raise ConfigError(
            "runtime.mode=async: rollout and actor ranks overlap; use split placement."
        )
    actor = rt.engines.get("actor")
    rollout = rt.engines.get("rollout")
    with stage("plan weight push"):
        stream_group = _stream_group(rt.config.runtime.fault_timeout)
        service = _weight_service(rt, actor, rollout)
    if rollout is not None:
        with stage("async rollout"):
            _run_rollout(rt, nodes, rollout_layout, trainer_layout, service, stream_group)
    elif actor is not None:
        with stage("async trainer"):
            _run_trainer(rt, program, nodes, rollout_layout, trainer_layout, service,
                         stream_group)


def _stream_group(timeout: float) -> Any:
    """A gloo group over every rank for the streams (CPU bytes), unless the default is gloo.

    Created collectively on every rank. Samples are CPU tensors, which NCCL cannot send.
    """
    import datetime

    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))


def _weight_service(rt: WorkerRuntime, actor: Any, rollout: Any) -> Any:
    """Builds the run's weight sync (collective) with its transport on a group of its own.

    The push runs the transport on background threads, so its group carries nothing else.
    """
    import datetime

    import torch.distributed as dist

    from peerflow.reshard import WeightSyncService

    cfg = rt.config
    group = dist.new_group(timeout=datetime.timedelta(seconds=cfg.runtime.fault_timeout))
    return WeightSyncService.build(actor, rollout, transport=cfg.weight_sync.transport,
                                   bucket_bytes=cfg.weight_sync.bucket_bytes, group=group)


def _run_rollout(
    rt: WorkerRuntime,
    nodes: list[Any],
    rollout_layout: Any,
    trainer_layout: Any,
    service: Any,
    stream_group: Any = None,
) -> None:
    from peerflow.streaming.assignment import TokenBalancer
    from peerflow.streaming.rollout_loop import RolloutStreamer, make_generate
    from peerflow.streaming.staleness import StalenessScheduler
    from peerflow.streaming.transport import DATA_TAG, WEIGHT_TAG, StreamReceiver, StreamSender
    from peerflow.streaming.weight_push import WeightReceiver
    from peerflow.worker.executors import executor_for
    from peerflow.worker.rollout import step_seed
    from peerflow.worker.sampler import split_evenly

    cfg = rt.config
    timeout = cfg.runtime.fault_timeout
    dp, dp_size = rollout_layout.dp_rank(rt.rank), rollout_layout.dp
    quota = split_evenly(cfg.run.prompts_per_step, dp_size, dp)
    resumed = restore_latest(rt.run_dir, engines=rt.engines, rank=rt.rank)
    start_step = resumed.step if resumed is not None else 0
    scheduler = StalenessScheduler(
        max_staleness=cfg.runtime.max_staleness, quota=quota, next_step=start_step
    )
    trained = trained_groups(resumed.inflight if resumed is not None else None)
    pending = replay_prompts(rt.sampler, trained.get(rt.rank, []))
    group_nodes = [n for n in nodes if n.kind in ROLLOUT_KINDS]

    def per_group(batch: Any) -> Any:
        metrics = StepMetrics()
        for node in group_nodes:
            batch = executor_for(node.kind)(rt, node, batch, metrics)
        return batch

    def sampling_for(open_step: int, call: int) -> Any:
        return cfg.rollout.sampling.to_params(
            seed=step_seed(cfg.seed, open_step + 1, rt.dp_rank, call)
        )

    chunk = cfg.runtime.partial_rollout_tokens or max(cfg.rollout.sampling.max_tokens // 4, 1)
    engine = rt.engine("rollout")
    spans = _tracer(rt)
    weights = WeightReceiver(
        service=service,
        receiver=StreamReceiver(
            sources=tuple(sorted(service.plan.sources)),
            tag=WEIGHT_TAG,
            group=stream_group,
            timeout=timeout,
            what="weights",
        ).start(),
    ).start()
    streamer = RolloutStreamer(
        engine=engine,
        generate=make_generate(
            engine, rt.tokenizer, partial_rollout=cfg.runtime.partial_rollout, chunk_tokens=chunk
        ),
        draw=rt.sampler.draw,
        sampling_for=sampling_for,
        per_group=per_group,
        scheduler=scheduler,
        balancer=TokenBalancer(num_consumers=trainer_layout.dp, source_index=dp),
        trainer_layout=trainer_layout,
        sender=StreamSender(tag=DATA_TAG, group=stream_group, timeout=timeout),
        weights=weights,
        steps=cfg.run.steps,
        rank=rt.rank,
        prompts_per_call=cfg.runtime.async_prompts_per_call,
        heartbeat_s=max(timeout / 6, 0.5),
        spans=spans,
        pending=pending,
    )
    try:
        streamer.run()
    finally:
        spans.flush()


def _run_trainer(
    rt: WorkerRuntime,
    program: Any,
    nodes: list[Any],
    rollout_layout: Any,
    trainer_layout: Any,
    service: Any,
    stream_group: Any = None,
) -> None:
    from peerflow.streaming.accumulator import MicroBatchAccumulator, StepInbox
    from peerflow.streaming.samplers import MicroBatchBudget, get_sampler
    from peerflow.streaming.trainer_loop import TrainerStreamer, make_pusher_fn
    from peerflow.streaming.transport import (
        DATA_TAG,
        WEIGHT_TAG,
        Heartbeat,
        Kind,
        StreamReceiver,
        StreamSender,
    )
    from peerflow.streaming.weight_push import WeightPusher
    from peerflow.worker.executors import executor_for
    from peerflow.worker.loop import finish_metrics, record_batch_metrics

    cfg = rt.config
    timeout = cfg.runtime.fault_timeout
    group = program.process_group("actor")
    first_trainer = min(trainer_layout.global_ranks)
    resumed = restore_latest(rt.run_dir, engines=rt.engines, rank=rt.rank)
    start_step = resumed.step if resumed is not None else 0
    if rt.estimator is not None:  # batch-wide statistics span the trainer group
        rt.estimator.process_group = group
        rt.estimator.group_replicas = trainer_layout.world_size // trainer_layout.dp
    micro_nodes = [n for n in nodes if n.kind in MICRO_BATCH_KINDS]
    step_nodes = [
        n for n in nodes if n.kind not in (*MICRO_BATCH_KINDS, *SKIPPED_KINDS, *ROLLOUT_KINDS)
    ]
    node_types = {name: rt.pm.registry("node").get(name) for name in rt.pm.registry("node").names()}

    def run_nodes(selected: list[Any]) -> Any:
        def run(batch: Any, metrics: Any) -> Any:
            for node in selected:
                batch = executor_for(node.kind, node_types.get(node.kind))(rt, node, batch, metrics)
            return batch

        return run

    writer = _writer(rt, start_step) if rt.rank == first_trainer else None
    progress = None
    if writer is not None:
        from peerflow.outputs import StepProgress

        progress = StepProgress(cfg.run.steps, start=start_step)
    sources = tuple(rollout_layout.global_ranks)
    sender = StreamSender(tag=WEIGHT_TAG, group=stream_group, timeout=timeout)
    pusher = WeightPusher(service=service, sender=sender)
    spans = _tracer(rt)
    trained = trained_groups(resumed.inflight if resumed is not None else None)

    def end_step(step: int, batch: Any, metrics: StepMetrics, extra: dict[str, float]) -> None:
        record_batch_metrics(batch, metrics)
        for name, value in extra.items():
            if name.endswith("max") or name.startswith("queue/"):
                metrics.max(name, value)
            elif name.startswith("staleness/"):
                metrics.mean(name, value, max(len(batch), 1))
            else:
                metrics.mean(name, value)
        metrics.max("time/step", time.time() - step_started[0])
        step_started[0] = time.time()
        reduced = finish_metrics(all_reduce_metrics(metrics, group), step + 1)
        if writer is not None:
            writer.write(step + 1, reduced)
            if progress is not None:
                progress.update(step + 1, reduced)
        rt.step = step + 1
        rt.pm.hook.peerflow_end_of_step(step=step + 1, metrics=reduced, rank=rt.rank)
        if should_checkpoint(step + 1, cfg.run.checkpoint_every, cfg.run.steps):
            for src, gids in streamer.trained_groups.items():
                trained.setdefault(src, []).extend(gids)
            streamer.trained_groups.clear()
            save_step(rt.run_dir, step + 1, engines=rt.engines, rank=rt.rank,
                      inflight=trained_groups_state(trained), group=group,
                      keep_last=cfg.run.keep_last)

    step_started = [time.time()]
    receiver = StreamReceiver(
        sources=sources, tag=DATA_TAG, group=stream_group, timeout=timeout
    ).start()
    streamer = TrainerStreamer(
        receiver=receiver,
        inbox=StepInbox(sources=sources),
        accumulator=MicroBatchAccumulator(
            sampler=get_sampler(cfg.runtime.sampler),
            budget=MicroBatchBudget(max_tokens=cfg.trainer.micro_batch_tokens),
        ),
        per_micro_batch=run_nodes(micro_nodes),
        per_step=run_nodes(step_nodes),
        push=make_pusher_fn(pusher, rt.engine("actor")),
        end_step=end_step,
        new_metrics=StepMetrics,
        steps=cfg.run.steps,
        rank=rt.rank,
        stream_micro_batches=trainer_layout.world_size == 1,
        sync_every=max(cfg.weight_sync.every, 1),
        start_step=start_step,
        spans=spans,
        max_staleness=cfg.runtime.max_staleness,
    )
    beat = Heartbeat(sender=sender, targets=sources, interval=max(timeout / 6, 0.5)).start()
    try:
        if start_step:  # the rollout engines start from the initial weights
            pusher.push(rt.engine("actor"), start_step)
        streamer.run()
    finally:
        beat.stop()
        spans.flush()
        if writer is not None:
            writer.close()
    pusher.drain()
    for dst in sources:
        sender.send(dst, Kind.STOP)
    sender.flush()
    while not receiver.all_stopped:  # groups beyond the last step are not trained
        receiver.get(timeout=0.5)
    receiver.join()
