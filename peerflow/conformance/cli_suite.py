"""The suite as `peerflow conformance NAME` runs it: adapter from `--peerflow-adapter`.

pytest collects this file when given its path; each class is deselected unless the
named adapter is of its kind.
"""

from __future__ import annotations

from peerflow.conformance.suite import RolloutAdapterSuite, TrainAdapterSuite


class TestRolloutAdapter(RolloutAdapterSuite):
    """The named rollout adapter."""


class TestTrainAdapter(TrainAdapterSuite):
    """The named train adapter."""
