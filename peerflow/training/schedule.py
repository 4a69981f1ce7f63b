"""The learning-rate schedule every train engine steps: warm-up, then constant, linear or cosine.

One implementation for every adapter (fsdp, deepspeed, megatron): a torch `LambdaLR` built
by Hugging Face transformers' schedule functions, over the adapter's torch optimiser.

* It counts **optimiser steps** (`trainer.mini_batches` per training step): the adapter
  steps it right after each optimiser step (DeepSpeed's engine does so itself when given
  the scheduler).
* `warmup_steps` rise linearly to `lr` from 0 (`constant`; the first optimiser step of a
  warm-up runs at lr 0, as in transformers, TRL and verl) or from the floor (`linear`,
  `cosine`); then `constant` keeps `lr`, `linear` and `cosine` decay to
  `min_lr_ratio * lr` at `total_steps` and stay there
  (`transformers.get_wsd_schedule` with no stable phase).
* Its state (`state_dict()`: steps taken, base learning rates) is saved with the
  optimiser and restored before the next step, so a resumed run continues the schedule
  exactly; the shape itself is rebuilt from the config.
"""

from __future__ import annotations

from typing import Any

import torch

from peerflow.engines.train import OptimSettings
from peerflow.errors import ConfigError
from peerflow.plugins.hookspecs import hookimpl

SCHEDULES = ("constant", "linear", "cosine")


def schedule_problems(optim: OptimSettings) -> list[str]:
    """What is wrong with the schedule of `optim` (empty when it can be built)."""
    kind, warmup, total = optim.lr_schedule, optim.warmup_steps, optim.total_steps
    if kind not in SCHEDULES:
        return [f"trainer.lr_schedule={kind!r}: use one of {', '.join(SCHEDULES)}."]
    if kind != "constant" and total <= warmup:
        return [
            f"trainer.lr_schedule={kind!r} decays over the run's optimiser steps "
            f"({total}: run.steps x trainer.mini_batches), which must exceed its "
            f"{warmup} warm-up steps; shorten the warm-up or use lr_schedule: constant."
        ]
    return []


def build_lr_scheduler(optimizer: torch.optim.Optimizer,
                       optim: OptimSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's learning-rate schedule over `optimizer` (its `lr` is the peak).

    Args:
        optimizer: A torch optimiser whose param groups hold the peak learning rate.
        optim: `lr_schedule`, `warmup_steps`, `total_steps`, `min_lr_ratio`.

    Raises:
        ConfigError: an unknown schedule, or a decaying one whose warm-up lasts the run.
    """
    from transformers import get_constant_schedule_with_warmup, get_wsd_schedule

    problems = schedule_problems(optim)
    if problems:
        raise ConfigError("\n".join(problems))
    if optim.lr_schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=optim.warmup_steps)
    return get_wsd_schedule(
        optimizer, num_warmup_steps=optim.warmup_steps, num_stable_steps=0,
        num_decay_steps=optim.total_steps - optim.warmup_steps, decay_type=optim.lr_schedule,
        min_lr_ratio=optim.min_lr_ratio,
    )


@hookimpl
def peerflow_validate_config(config: Any, pm: Any) -> list[str]:
    """The trainer's schedule against the run's length (before any worker starts)."""
    return schedule_problems(config.trainer.optim_settings(steps=config.run.steps))
