"""Errors PeerFlow raises for bad input.

Each message names the object, the bad value, what was expected and the fix.
"""

from __future__ import annotations


class PeerFlowError(Exception):
    """Base class of every error PeerFlow raises on purpose."""


class ConfigError(PeerFlowError):
    """A run configuration is invalid (unknown key, wrong type, impossible layout)."""


class PluginError(PeerFlowError):
    """A plugin is broken or two plugins disagree."""


class UnknownNameError(PluginError):
    """A config names a backend, reward, estimator, … that no installed plugin registers."""


class DuplicateNameError(PluginError):
    """Two plugins register the same name for the same kind."""


class EngineNotInstalledError(PluginError):
    """A registered adapter was selected but the engine it wraps is not installed."""


class ShardError(PeerFlowError):
    """A shard layout is invalid: out of bounds, overlapping or incomplete."""


class WorkerFailedError(PeerFlowError):
    """A peer process died or raised; carries the failed rank, host and stage."""


#: Exit status of a run or worker stopped by Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED_EXIT = 130


class RunInterruptedError(PeerFlowError):
    """The user stopped a run (Ctrl-C, SIGTERM to the launcher); every worker was stopped."""
