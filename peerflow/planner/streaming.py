"""The async program: which node runs in which phase of the streaming schedule.

In `runtime.mode: async` rollout and trainer ranks are disjoint and meet only through
the sample and weight streams, so a step is not one ordered op list but four phases,
each a property of the node's kind (`KindSpec.phase`):

* `generate` — the rollout rank's streamed generation (admission under the staleness bound);
* `per_group` — run on each finished prompt group on its rollout rank (e.g. `reward`);
* `per_micro_batch` — trainer forwards as micro-batches fill (`old_logprob`, `values`, …);
* `per_step` — the rest on the trainer's whole step (`advantage`, `train_actor`, …);
* `weight_sync` — replaced by the asynchronous, bucketed weight push.

Every rank runs the same `plan_run`, so all agree on the phases.
"""

from __future__ import annotations

from typing import Any

from peerflow.errors import ConfigError
from peerflow.layout import ParallelLayout

#: Phases that run on rollout ranks (the others run on trainer ranks).
ROLLOUT_PHASES = ("generate", "per_group")


def check_async_config(config: Any, layouts: dict[str, ParallelLayout], pm: Any = None) -> None:
    """Raises `ConfigError` for settings async mode cannot run.

    Args:
        config: The `RunConfig` (`runtime.mode: async`).
        layouts: The placed roles (`place_roles`).
        pm: The plugin manager, to check `runtime.sampler` (`None`: not checked).
    """
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
    if pm is not None:
        pm.get("sampler", rt.sampler)


def node_phase(node: Any, kinds: dict[str, Any], roles: dict[str, ParallelLayout]) -> str:
    """Returns the streaming phase of `node`, checking it runs on the right side.

    Raises:
        ConfigError: a node of a rollout phase whose role lives on trainer ranks, or the
            reverse (it could not see the samples there).
    """
    phase = kinds[node.kind].phase
    on_rollout = set(roles[node.role].global_ranks) <= set(roles["rollout"].global_ranks)
    if phase != "weight_sync" and on_rollout != (phase in ROLLOUT_PHASES):
        side = "rollout" if phase in ROLLOUT_PHASES else "trainer"
        raise ConfigError(
            f"node {node.name!r} (kind {node.kind}, phase {phase}) runs on role {node.role}, "
            f"which async mode places on the other side; give it a {side}-side role."
        )
    return phase
