"""Placing roles on ranks: one `ParallelLayout` per role.

* `colocated` — every role spans all ranks (engines time-shared); the rollout roles
  (`rollout`, `reward`) take `rollout.layout`'s tp/pp, the trainer roles (`actor`, `ref`,
  `critic`) take `trainer.layout`'s, and dp fills the ranks (`dp` 0 or 1 means "fill";
  another value must fill them exactly).
* `split` — the rollout roles get the first `dp·tp·pp·ep` ranks of `rollout.layout`,
  the trainer roles the next ones of `trainer.layout`; one side may say `dp: 0` to take
  every rank the other leaves.
"""

from __future__ import annotations

from typing import Any

from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout
from peerflow.workflow.roles import ROLES


def _model_size(section: Any) -> int:
    return section.layout.tp * section.layout.pp * section.layout.ep


def _fill(
    key: str, section: Any, ranks: tuple[int, ...], auto_dp: tuple[int, ...]
) -> ParallelLayout:
    lc = section.layout
    model = _model_size(section)
    if len(ranks) % model:
        raise ConfigError(
            f"{key}.layout: tp·pp·ep = {lc.tp}·{lc.pp}·{lc.ep} = {model} does not divide the "
            f"{len(ranks)} ranks the role gets; change tp/pp/ep or the number of processes."
        )
    dp = len(ranks) // model
    if lc.dp not in auto_dp and lc.dp != dp:
        raise ConfigError(
            f"{key}.layout.dp={lc.dp} with tp·pp·ep={model} needs {lc.dp * model} ranks, but "
            f"the role gets {len(ranks)}; set {key}.layout.dp: {dp} (or 0 to fill)."
        )
    return ParallelLayout(dp=dp, tp=lc.tp, pp=lc.pp, ep=lc.ep, ranks=ranks)


def place_roles(config: Any, world_size: int) -> dict[str, ParallelLayout]:
    """Returns the layout of every role for `config.runtime.placement` on `world_size` ranks.

    Raises:
        ConfigError: the layouts cannot fill the ranks (naming the key and the fix).
    """
    if world_size < 1:
        raise ConfigError(f"world size {world_size}: need at least one process (--nprocs).")
    placement = config.runtime.placement
    everyone = tuple(range(world_size))
    if placement == "colocated":
        sides = {"rollout": _fill("rollout", config.rollout, everyone, (0, 1)),
                 "trainer": _fill("trainer", config.trainer, everyone, (0, 1))}
    elif placement == "split":
        sizes = {}
        for key in ("rollout", "trainer"):
            section = getattr(config, key)
            sizes[key] = section.layout.dp * _model_size(section) if section.layout.dp else None
        if sizes["rollout"] is None and sizes["trainer"] is None:
            raise ConfigError(
                "runtime.placement=split: rollout.layout.dp and trainer.layout.dp are both 0; "
                "give one of them a size (the other fills the remaining ranks)."
            )
        for key, other in (("rollout", "trainer"), ("trainer", "rollout")):
            if sizes[key] is None:
                sizes[key] = world_size - sizes[other]
        if sizes["rollout"] + sizes["trainer"] != world_size or min(sizes.values()) < 1:
            raise ConfigError(
                f"runtime.placement=split: rollout needs {sizes['rollout']} ranks and trainer "
                f"{sizes['trainer']}, but there are {world_size} processes; run with "
                f"--nprocs {max(sizes['rollout'], 1) + max(sizes['trainer'], 1)}, change the "
                "layouts, or set one side's dp: 0 to fill."
            )
        cut = sizes["rollout"]
        sides = {"rollout": _fill("rollout", config.rollout, everyone[:cut], (0,)),
                 "trainer": _fill("trainer", config.trainer, everyone[cut:], (0,))}
    else:
        raise ConfigError(f"runtime.placement={placement!r}; use colocated or split.")
    return {name: sides[role.side] for name, role in ROLES.items()}
