"""The hooks a PeerFlow plugin can implement.

Registration hooks (`peerflow_register_*`) receive a `register` callback and call it
once per class they provide; each class carries the `name` users select it by, and the
registry owns naming and collision policy. Lifecycle hooks are called by the runtime on
every rank where the event happens. Hooks evolve by gaining arguments (an
implementation may accept fewer), never by renaming.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

from peerflow.plugins.registry import KINDS, Kind

PROJECT = "peerflow"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


def _registration_hookspec(kind: Kind) -> Callable[[Any], None]:
    """Returns the hookspec `kind.hook(register)` that fills the registry of `kind`."""

    def hook(register: Any) -> None:
        del register

    base = f"\n            Each class subclasses `{kind.base}`." if kind.base else ""
    hook.__name__ = hook.__qualname__ = kind.hook
    hook.__doc__ = f"""Register {kind.label}s.

    Args:
        register: Call `register(cls)` for each class the plugin provides; the class's
            `name` is what `{kind.config_key}` selects.{base}

    Returns:
        Nothing; the return value is ignored.

    Since: {kind.since}.
    """
    return hookspec(hook)


#: The registration hookspecs, one per `KINDS` entry (`peerflow_register_rollout_engines`,
#: `peerflow_register_train_engines`, …): a new kind of registered class gets its hook here.
globals().update({kind.hook: _registration_hookspec(kind) for kind in KINDS.values()})


@hookspec
def peerflow_validate_config(config: Any, pm: Any) -> list[str] | None:
    """Check a run config before any worker process starts.

    Called by `peerflow.config.validate_config` (`peerflow train`, `peerflow config
    validate`) after names and option sections are checked.

    Args:
        config: The structured `peerflow.config.RunConfig`.
        pm: This process's `PluginManager` (to look up registered classes).

    Returns:
        The problems found, each naming the key and the fix; empty or `None` when the
        config is fine. Every implementation's problems are reported together.

    Since: 0.2.
    """


@hookspec
def peerflow_before_weight_sync(version: int, role: str, rank: int) -> None:
    """Called on every rank taking part in a weight sync, before any bucket moves.

    Args:
        version: The weight version about to be published.
        role: The role of the engine on this rank (`actor`, `rollout`, …).
        rank: Global rank of this process.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_after_weight_sync(version: int, role: str, rank: int, stats: Any) -> None:
    """Called on every rank taking part in a weight sync, after the new version is live.

    Args:
        version: The weight version now published.
        role: The role of the engine on this rank.
        rank: Global rank of this process.
        stats: A `peerflow.engines.WeightSyncStats` with time split by phase and bytes.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """


@hookspec
def peerflow_end_of_step(step: int, metrics: dict[str, float], rank: int) -> None:
    """Called on every rank when a training step ends.

    Args:
        step: The step that just finished (1-based).
        metrics: The step's metrics as written to `metrics.jsonl` (read-only).
        rank: Global rank of this process.

    Returns:
        Nothing; the return value is ignored.

    Since: 0.1.
    """
