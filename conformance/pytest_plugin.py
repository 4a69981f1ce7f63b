"""pytest plugin of the PeerFlow conformance suite (`pytest11` entry point).

Adds `--peerflow-adapter NAME`: the registered engine name the suite's tests run against
when a test module uses the suite's `adapter_name` fixture without overriding it.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    """Adds the `--peerflow-adapter` option."""
    group = parser.getgroup("peerflow", "PeerFlow adapter conformance suite")
    group.addoption(
        "--peerflow-adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="registered engine adapter to run the conformance suite against (repeatable)",
    )
