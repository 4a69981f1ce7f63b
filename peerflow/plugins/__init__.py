"""PeerFlow's plugin system: pluggy hookspecs, entry-point loading, name registries.

A plugin is a module (or object) with functions decorated by `peerflow.plugins.hookimpl`,
published under the entry-point group `peerflow`::

    [project.entry-points.peerflow]
    my_engine = "my_package.peerflow_plugin"
"""

from peerflow.plugins.hookspecs import hookimpl, hookspec
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
    "Registry",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "load_plugins",
]
