"""DAPO's overlong reward shaping and overlong filtering (Yu et al., 2025, §3.4).

* **Soft overlong punishment**: with the generation budget `L_max` (`max_tokens`) and a
  buffer `L_cache`, an answer of `|y|` tokens gets
  `R_length = 0` if `|y| <= L_max - L_cache`, else
  `-penalty · (|y| - (L_max - L_cache)) / L_cache` (reaching `-penalty` at `L_max`),
  added to its reward (verl's `overlong_buffer` in its DAPO reward manager). `|y|`
  counts the tokens the model generated (`Batch.trained_lengths`): a multi-turn
  trajectory's observation tokens are not the model's length.
* **Overlong filtering**: answers cut off by a limit (`finish_reason` in `TRUNCATED`:
  `length` for a single answer; `max_tokens` or `max_turns` for a multi-turn trajectory
  cut off by `rollout.agent` limits) are left out of the loss — their `train_mask` is
  `False`, so they count neither in the loss nor in its normalisers.
"""

from __future__ import annotations

import torch

from peerflow.batch import Batch

#: `finish_reason`s of samples cut off by a limit rather than ended by the model or the
#: environment (single answers: `length`; agent trajectories: `max_tokens`, `max_turns`).
TRUNCATED = frozenset({"length", "max_tokens", "max_turns"})


def overlong_penalty(lengths: torch.Tensor, max_tokens: int, buffer: int,
                     penalty: float) -> torch.Tensor:  # [num_samples], float64, <= 0
    """DAPO's soft overlong punishment of answers with `lengths` tokens.

    Raises:
        ValueError: `buffer` is not in `[1, max_tokens]`.
    """
    if not 0 < buffer <= max_tokens:
        raise ValueError(
            f"algorithm.overlong.buffer={buffer} must lie in [1, rollout.sampling.max_tokens="
            f"{max_tokens}]; lower the buffer or set it to 0 to disable the punishment."
        )
    exceed = (lengths.to(torch.float64) - (max_tokens - buffer)).clamp(min=0)
    return -penalty * (exceed / buffer).clamp(max=1.0)


def shape_overlong(batch: Batch, *, max_tokens: int, buffer: int, penalty: float,
                   filter_truncated: bool) -> dict[str, float]:
    """Applies the soft punishment to `reward` and the filter to `train_mask`, in place.

    The raw reward is kept in `score` (unless a previous shaping already kept it).

    Returns:
        `overlong/penalty_mean` (mean reward lost) and `overlong/filtered_fraction`.
    """
    metrics: dict[str, float] = {}
    n = len(batch)
    if buffer > 0:
        reward = batch["reward"]
        if "score" not in batch:
            batch.set("score", reward.clone())
        shaped = overlong_penalty(batch.trained_lengths(), max_tokens, buffer, penalty)
        batch.set("reward", (reward.to(torch.float64) + shaped).to(reward.dtype))
        metrics["overlong/penalty_mean"] = float(-shaped.mean()) if n else 0.0
    if filter_truncated:
        truncated = torch.tensor([r in TRUNCATED for r in batch["finish_reason"]],
                                 dtype=torch.bool)
        keep = ~truncated
        if "train_mask" in batch:
            keep = keep & batch["train_mask"].to(torch.bool)
        batch.set("train_mask", keep)
        metrics["overlong/filtered_fraction"] = float(truncated.double().mean()) if n else 0.0
    return metrics
