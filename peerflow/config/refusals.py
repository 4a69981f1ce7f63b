"""What the selected engines cannot do, refused at `peerflow config validate`.

The one way an engine says "I can't": its `Capabilities` (and `Capabilities.reasons`, why
it lacks a flag). Each `Demand` below is a setting that needs a flag of the engine on one
side (`rollout` or `trainer`); a config that sets it for an engine without the flag is
refused before any process starts, naming the setting, the engine's reason, the fix and
the installed backends that can. Workers never re-check: what passes here is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import attrs

from peerflow.errors import UnknownNameError
from peerflow.workflow.roles import ROLES

Side = Literal["rollout", "trainer"]
_KINDS: dict[str, str] = {"rollout": "rollout_engine", "trainer": "train_engine"}


@attrs.frozen(kw_only=True)
class Demand:
    """A setting that needs a capability of the engine on one side."""

    setting: str
    """The config key (`trainer.padding_free`)."""
    side: Side
    """Whose engine needs the capability: `rollout` or `trainer`."""
    capability: str
    """The `Capabilities` flag."""
    asks: Callable[[Any], Any]
    """The value the config sets, from the `RunConfig`; falsy when the setting does not
    ask for the capability."""
    fix: str
    """What to change instead (besides picking a backend that can)."""


def _replay(config: Any, *modes: str) -> str | None:
    """`trainer.routing_replay` when it is one of `modes` (MoE routing replay)."""
    mode = config.trainer.routing_replay
    return mode if mode in modes else None


def _layout(side: Side, dim: str, capability: str) -> Demand:
    def asks(config: Any) -> Any:
        degree = getattr(getattr(config, side).layout, dim)
        return degree if degree > 1 else None

    return Demand(setting=f"{side}.layout.{dim}", side=side, capability=capability,
                  asks=asks, fix=f"set {side}.layout.{dim}: 1")


DEMANDS: tuple[Demand, ...] = (
    Demand(setting="rollout.sampling.stop", side="rollout", capability="stop_strings",
           asks=lambda config: config.rollout.sampling.stop,
           fix="remove rollout.sampling.stop (answers still end at EOS and max_tokens)"),
    *(_layout(side, dim, flag) for side in ("rollout", "trainer")
      for dim, flag in (("tp", "tensor_parallel"), ("pp", "pipeline_parallel"),
                        ("ep", "expert_parallel"))),
    Demand(setting="trainer.padding_free", side="trainer", capability="padding_free",
           asks=lambda config: config.trainer.padding_free is True,
           fix="set trainer.padding_free: auto (the engine then pads) or false"),
    Demand(setting="trainer.activation_checkpointing", side="trainer",
           capability="activation_checkpointing",
           asks=lambda config: config.trainer.activation_checkpointing,
           fix="set trainer.activation_checkpointing: false"),
    Demand(setting="trainer.routing_replay", side="trainer", capability="routing_replay",
           asks=lambda config: _replay(config, "r2", "r3"),
           fix="set trainer.routing_replay: off"),
    Demand(setting="trainer.routing_replay", side="rollout", capability="routed_experts",
           asks=lambda config: _replay(config, "r3"),
           fix="set trainer.routing_replay: r2 (the trainer's own routes) or off"),
    *(Demand(setting="trainer.lora", side=side, capability="lora",
             asks=lambda config: config.trainer.lora,
             fix="remove trainer.lora to train every weight") for side in ("trainer", "rollout")),
)
"""Every setting that needs an engine capability (one entry per setting and side)."""


def _engine(pm: Any, side: Side, config: Any) -> type | None:
    """The selected engine class of `side`, or `None` (an unknown name is reported elsewhere)."""
    try:
        return pm.get(_KINDS[side], getattr(config, side).backend)
    except UnknownNameError:
        return None


def _able(pm: Any, side: Side, capability: str) -> str:
    """The installed backends of `side` that declare `capability`, as `a or b`."""
    registry = pm.registry(_KINDS[side])
    able = [n for n in registry.names() if getattr(registry.get(n).capabilities, capability)]
    return " or ".join(able) or "(none installed declares it)"


def refusal(demand: Demand, config: Any, pm: Any) -> str | None:
    """The message refusing `demand` for the selected engine, or `None` when it can run."""
    value = demand.asks(config)
    cls = _engine(pm, demand.side, config)
    if not value or cls is None or getattr(cls.capabilities, demand.capability):
        return None
    backend = getattr(config, demand.side).backend
    able = _able(pm, demand.side, demand.capability)
    return (f"{demand.setting}{_show(value)}: {demand.side}.backend={backend!r} "
            f"{_lacks(cls, demand.capability)}. Fix: {demand.fix}, or use {demand.side}.backend "
            f"{able}.")


def _lacks(cls: type, capability: str) -> str:
    """`does not declare Capabilities.<flag>`, with the engine's reason when it gives one."""
    reason = cls.capabilities.reasons.get(capability)
    return f"does not declare Capabilities.{capability}" + (f": {reason}" if reason else "")


def _show(value: Any) -> str:
    """`=<value>` as YAML would write it, or nothing for a section (`trainer.lora`)."""
    if value is True:
        return "=true"
    if isinstance(value, list | tuple):
        return f"={list(value)}"
    return f"={value}" if isinstance(value, int | float | str) else ""


def _multiprocess(config: Any, pm: Any) -> list[str]:
    """A rollout engine that drives its own tp workers is hosted on one rank per replica."""
    cls = _engine(pm, "rollout", config)
    layout = config.rollout.layout
    if cls is None or not cls.capabilities.multiprocess or layout.tp * layout.pp == 1:
        return []
    backend = config.rollout.backend
    return [f"rollout.layout tp={layout.tp} pp={layout.pp}: rollout.backend={backend!r} drives "
            "its own tensor-parallel workers from one rank per replica (Capabilities."
            f"multiprocess). Fix: set rollout.layout.tp and pp to 1 and the engine's own "
            f"degree in rollout.{backend} (e.g. rollout.vllm.tensor_parallel_size)."]


def critic_problems(config: Any, pm: Any, roles: set[str]) -> list[str]:
    """A workflow with a value-head role (`critic`) needs a train engine declaring `value_head`.

    Args:
        config: A structured `RunConfig`.
        pm: The plugin manager.
        roles: The roles of the workflow's nodes (the planner's graph check passes them).
    """
    cls = _engine(pm, "trainer", config)
    heads = sorted(r for r in roles if r in ROLES and ROLES[r].value_head)
    if not heads or cls is None or cls.capabilities.value_head:
        return []
    able = _able(pm, "trainer", "value_head")
    return [f"workflow (role {', '.join(heads)}): trainer.backend={config.trainer.backend!r} "
            f"{_lacks(cls, 'value_head')}; the graph's `values` and `train_critic` nodes need "
            f"a critic. Fix: use trainer.backend {able}, or a workflow without a critic "
            "(workflow.graph: grpo)."]


def capability_problems(config: Any, pm: Any) -> list[str]:
    """Every setting of `config` the selected engines cannot run, one message each.

    The workflow's needs (a critic) are checked with the graph, by the planner's
    validation (`critic_problems`).

    Args:
        config: A structured `RunConfig`.
        pm: The `peerflow.plugins.PluginManager` of this process.
    """
    problems = [message for demand in DEMANDS
                if (message := refusal(demand, config, pm)) is not None]
    return problems + _multiprocess(config, pm)
