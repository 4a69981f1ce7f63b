"""The adapter conformance suite: oracle resharder, base test classes, pytest plugin.

Authors subclass `RolloutAdapterSuite` or `TrainAdapterSuite` (or run
`peerflow conformance NAME`). An adapter declares itself to the suite without importing
this package: the suite finds the engine class in the plugin registry and reads optional
classmethods on it, listed once in `peerflow.conformance.hooks.HOOKS` (docs/conformance.md,
"Conformance hooks").
"""

from __future__ import annotations

from peerflow.conformance.oracle import arange_globals, assemble, cut, oracle_reshard, shard_all
from peerflow.conformance.profile import DEFAULT_LAYOUTS, AdapterProfile
from peerflow.conformance.suite import RolloutAdapterSuite, TrainAdapterSuite

__all__ = [
    "DEFAULT_LAYOUTS",
    "AdapterProfile",
    "RolloutAdapterSuite",
    "TrainAdapterSuite",
    "arange_globals",
    "assemble",
    "cut",
    "oracle_reshard",
    "shard_all",
]
