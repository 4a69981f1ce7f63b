"""The multi-host tests' hosts: network namespaces acting as machines (`netns.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from netns import Hosts  # this folder's helper (pytest puts it on sys.path)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    """Two hosts on one private network, removed with what they run after the test."""
    made = Hosts.create(2)
    yield made
    made.destroy()
