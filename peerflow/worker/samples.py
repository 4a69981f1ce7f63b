"""Samples of a step, decoded on the ranks that hold them and written once.

Every rank of the schedule's group takes its own first `limit` samples by `sample_id`
and decodes only those (`sample_records`); one `all_gather_values` over the group brings
these few strings and numbers to every rank; the reporting rank keeps the run's first
`limit` samples by `sample_id` and writes them (`peerflow.outputs.samples`). Taking
`limit` per rank, not `limit / world`, keeps the result right when ranks hold the same
samples (tensor-parallel replicas, or a rollout rank beside the trainer that received
them): duplicates are merged, keeping the record that knows most (e.g. the advantage).
The same code serves sync and async runs (async: trainer ranks only) and evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from peerflow.batch import Batch
from peerflow.outputs.samples import write_samples
from peerflow.ragged import RaggedField
from peerflow.worker.executors import REWARD_COMPONENTS

if TYPE_CHECKING:
    from peerflow.worker.runtime import WorkerRuntime


def _advantages(batch: Batch) -> list[float | None]:
    """Each sample's advantage: the mean over its response tokens (or its scalar)."""
    column = batch.fields.get("advantages")
    if isinstance(column, RaggedField):
        return [float(row.float().mean()) if len(row) else None for row in column.rows()]
    if isinstance(column, torch.Tensor) and column.dim() == 1 and len(column) == len(batch):
        return [float(v) for v in column.tolist()]
    return [None] * len(batch)


def _decode(tokenizer: Any, batch: Batch, name: str, *, skip_special: bool) -> list[str]:
    rows = [row.tolist() for row in batch.ragged(name).rows()]
    return tokenizer.batch_decode(rows, skip_special_tokens=skip_special)


def sample_records(batch: Batch, tokenizer: Any, step: int, *, limit: int | None = None,
                   advantage: bool = True) -> list[dict[str, Any]]:
    """This rank's first `limit` samples by `sample_id`, decoded and JSON-ready.

    Args:
        batch: A host batch with `prompt_ids` and `response_ids` (others: none taken).
        tokenizer: The run's tokenizer.
        step: The step written into every record.
        limit: How many samples at most (`None`: all).
        advantage: Add the `advantage` field (training samples).

    Returns:
        One dict per sample (fields in `peerflow.outputs.samples`), by `sample_id`.
    """
    if not len(batch) or "response_ids" not in batch or "prompt_ids" not in batch:
        return []
    order = torch.argsort(batch.sample_id)
    if limit is not None:
        order = order[:limit]
    picked = batch.select(order)
    prompts = _decode(tokenizer, picked, "prompt_ids", skip_special=False)
    responses = _decode(tokenizer, picked, "response_ids", skip_special=True)
    n = len(picked)
    rewards = picked["reward"].tolist() if "reward" in picked else [None] * n
    components = picked[REWARD_COMPONENTS] if REWARD_COMPONENTS in picked else [{}] * n
    finish = picked["finish_reason"] if "finish_reason" in picked else [None] * n
    turns = picked["num_turns"].tolist() if "num_turns" in picked else None
    advantages = _advantages(picked)
    lengths = picked.trained_lengths().tolist()
    records = []
    for i, (sample_id, group_id) in enumerate(zip(picked.sample_id.tolist(),
                                                  picked.group_id.tolist())):
        record: dict[str, Any] = {
            "step": int(step), "sample_id": int(sample_id), "group_id": int(group_id),
            "prompt": prompts[i], "response": responses[i], "reward": rewards[i],
            "components": {k: float(v) for k, v in dict(components[i]).items()},
        }
        if advantage:
            record["advantage"] = advantages[i]
        record.update(finish_reason=finish[i], response_tokens=int(lengths[i]))
        if turns is not None:
            record["num_turns"] = int(turns[i])
        records.append(record)
    return records


def merge_records(per_rank: Sequence[Sequence[dict[str, Any]]], limit: int | None = None,
                  key: tuple[str, ...] = ("sample_id",)) -> list[dict[str, Any]]:
    """Every rank's records as one list by `key`, duplicates merged, the first `limit`.

    Of two records of one sample, the one with more known (non-`null`) fields is kept.
    """
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for records in per_rank:
        for record in records:
            ident = tuple(record.get(k) for k in key)
            kept = merged.get(ident)
            if kept is None or _known(record) > _known(kept):
                merged[ident] = record
    ordered = [merged[ident] for ident in sorted(merged)]
    return ordered[:limit] if limit is not None else ordered


def _known(record: dict[str, Any]) -> int:
    return sum(v is not None for v in record.values())


def gather_records(records: list[dict[str, Any]], group: Any = None) -> list[list[dict]]:
    """Every rank's records (one `all_gather_values` over `group`; alone: just these)."""
    import torch.distributed as dist

    from peerflow.distributed.comm import all_gather_values

    if not (dist.is_available() and dist.is_initialized()):
        return [records]
    return all_gather_values(records, group, what="samples: every rank's records")


def write_step_samples(rt: WorkerRuntime, step: int, batch: Batch, *, group: Any,
                       reports: bool) -> list[dict[str, Any]]:
    """Writes `run.samples_per_step` samples of `step` (collective over `group`).

    Every rank of `group` calls it after each step; the reporting rank writes
    `samples/step_N.jsonl`. Does nothing when `run.samples_per_step` is 0.

    Returns:
        On the reporting rank, the records written (for the trackers); else none.
    """
    limit = rt.config.run.samples_per_step
    if not limit:
        return []
    mine = sample_records(batch, rt.tokenizer, step, limit=limit)
    merged = merge_records(gather_records(mine, group), limit)
    if not reports:
        return []
    write_samples(rt.run_dir, step, merged)
    return merged


def write_eval_samples(rt: WorkerRuntime, step: int,
                       batches: Sequence[tuple[str, Batch]]) -> None:
    """Writes every evaluation sample to `samples/eval_step_N.jsonl` (collective, world).

    Args:
        rt: This rank's runtime; rank 0 writes.
        step: The evaluated step.
        batches: `(mode, batch)` pairs of this rank (`greedy`, `sampled`), each batch
            carrying `reward` and `reward_components`.
    """
    mine = []
    for mode, batch in batches:
        for record in sample_records(batch, rt.tokenizer, step, advantage=False):
            mine.append({**record, "mode": mode})
    merged = merge_records(gather_records(mine), key=("mode", "sample_id"))
    if rt.rank == 0:
        write_samples(rt.run_dir, step, merged, evaluation=True)
