"""PeerFlow's plugin system: pluggy hookspecs, entry-point loading, name registries.

A plugin is a module (or object) with functions decorated by `peerflow.plugins.hookimpl`,
published under the entry-point group `peerflow`::

    [project.entry-points.peerflow]
    my_engine = "my_package.peerflow_plugin"

The hooks a plugin can implement, each written out with its arguments, return value and
an example, are the functions of `peerflow.plugins.hookspecs` (`help(hookspecs)`, or
`help(hookspecs.peerflow_validate_config)` for one):

* registration, one per kind of class (`register(cls)` once per class, `Register`):
  `peerflow_register_rollout_engines`, `…_train_engines`, `…_weight_transports`,
  `…_rewards`, `…_advantage_estimators`, `…_policy_losses`, `…_tasks`, `…_nodes`,
  `…_samplers`, `…_environments`, `…_tools`;
* `peerflow_validate_config(config, pm) -> list[str] | None` — the problems of a
  `RunConfig` (each naming the key and the fix), before any worker starts;
* lifecycle: `peerflow_before_weight_sync(version, role, rank)`,
  `peerflow_after_weight_sync(version, role, rank, stats)`,
  `peerflow_end_of_step(step, metrics, rank)`.

An implementation may accept fewer arguments than its hookspec (pluggy passes them by
name). CONTRIBUTING.md ("Writing an engine adapter") walks through a plugin end to end.
"""

from peerflow.plugins import hookspecs
from peerflow.plugins.hookspecs import Register, hookimpl, hookspec
from peerflow.plugins.manager import (
    PluginLoadError,
    PluginManager,
    get_plugin_manager,
    load_plugins,
)
from peerflow.plugins.registry import KINDS, Registry

__all__ = [
    "KINDS",
    "PluginLoadError",
    "PluginManager",
    "Register",
    "Registry",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "hookspecs",
    "load_plugins",
]
