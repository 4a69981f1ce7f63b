"""Running a train engine's step of the train layer on one rank, or on two processes.

The engine is built as a run builds it (`EngineContext` with the layout, rank, group,
device and sampling temperature; the adapter's default options; the layer's
`OPTIM`), takes its dp-rank's share of the fixed batch (every `dp`-th sample, so each
rank's mini-batch `k` is the reference's mini-batch `k` together), and reports what the
layer checks: the step's metrics, `version`, the weights it exports (`weight_sources` and
`materialize`) and the HF names they claim.

Two ranks run in two spawned processes over gloo (a file store in a temporary folder):
a process per rank is what a run has, and nothing one rank leaves in the parent's
process group state can help the other.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import attrs
import torch

from peerflow.conformance.profile import AdapterProfile
from peerflow.conformance.train_reference import OPTIM, TEMPERATURE, train_loss
from peerflow.engines import EngineContext
from peerflow.layout import ParallelLayout
from peerflow.shard import ShardSpec


@attrs.frozen(kw_only=True)
class RankResult:
    """What one rank's engine did in the layer's step (host tensors only)."""

    rank: int
    metrics: dict[str, float]
    """`train_step`'s metrics."""
    version: int
    """`engine.version` after the step."""
    specs: list[ShardSpec]
    """`weight_sources()` after the step."""
    tensors: dict[str, torch.Tensor] = attrs.field(repr=False)
    """The exported tensors by `local_name` (host copies)."""


def train_engine(profile: AdapterProfile, model_dir: str, *, layout: ParallelLayout,
                 rank: int, group: Any, device: str) -> Any:
    """The adapter's engine on `model_dir` as a run builds it, with the layer's settings."""
    context = EngineContext(model_path=model_dir, layout=layout, rank=rank, dtype="float32",
                            device=device, process_group=group, temperature=TEMPERATURE)
    return profile.cls(context, profile.cls.options_class(), OPTIM)


def exported(engine: Any) -> tuple[list[ShardSpec], dict[str, torch.Tensor]]:
    """`weight_sources()` and host copies of what `materialize` yields for them."""
    specs = list(engine.weight_sources())
    with engine.materialize(specs) as tensors:
        copies = {s.local_name: t.detach().to("cpu", copy=True) for s, t in zip(specs, tensors)}
    return specs, copies


def dp_share(batch: Any, layout: ParallelLayout, rank: int) -> Any:
    """This rank's samples: every `dp`-th, starting at its dp coordinate."""
    dp_rank = layout.coord(rank).dp
    return batch.select(list(range(dp_rank, len(batch), layout.dp)))


def step_on_rank(profile: AdapterProfile, model_dir: str, batch: Any, *,
                 layout: ParallelLayout, rank: int, group: Any, device: str) -> RankResult:
    """Builds the engine, runs one `train_step` on this rank's share, reports it."""
    engine = train_engine(profile, model_dir, layout=layout, rank=rank, group=group,
                          device=device)
    try:
        metrics = engine.train_step(dp_share(batch, layout, rank), train_loss())
        specs, tensors = exported(engine)
        return RankResult(rank=rank, metrics=dict(metrics), version=int(engine.version),
                          specs=specs, tensors=tensors)
    finally:
        engine.shutdown()


def _rank_main(rank: int, world: int, store: str, cls: type, model_dir: str,
               batch: Any, out: str) -> None:
    """One spawned rank of `run_two_ranks` (the entry `torch.multiprocessing` calls)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from peerflow.conformance.engines import rank_group
    from peerflow.distributed.devices import rank_device

    group = rank_group(rank, world, store)
    try:
        result = step_on_rank(AdapterProfile.of(cls), model_dir, batch,
                              layout=ParallelLayout(dp=world), rank=rank,
                              group=group, device=str(rank_device()))
        torch.save(attrs.asdict(result, recurse=False), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_two_ranks(profile: AdapterProfile, model_dir: str, batch: Any) -> list[RankResult]:
    """The layer's step at dp = 2, one spawned process per rank; both ranks' results.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank failed (its traceback).
    """
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory(prefix="peerflow-train-layer-") as out:
        store = os.path.join(out, "store")
        mp.start_processes(_rank_main, args=(world, store, profile.cls, model_dir, batch, out),
                           nprocs=world, start_method="spawn", join=True)
        return [RankResult(**torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False))
                for r in range(world)]


def step_here(profile: AdapterProfile, model_dir: str, batch: Any) -> RankResult:
    """The layer's step at dp = 1 in this process (the suite's one-rank group)."""
    from peerflow.conformance.engines import world_group
    from peerflow.distributed.devices import rank_device

    return step_on_rank(profile, model_dir, batch, layout=ParallelLayout(), rank=0,
                        group=world_group(), device=str(rank_device()))
