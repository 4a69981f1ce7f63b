"""The conformance hooks have one list, and nothing reads a hook it does not hold (issue 50)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from peerflow.conformance.hooks import HOOK_NAMES, hook_table
from peerflow.conformance.profile import AdapterProfile

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_table_is_the_one_list():
    assert hook_table() in (ROOT / "docs" / "conformance.md").read_text()


def test_every_hook_the_suite_reads_is_listed():
    """datasette's documented-hooks test: a hook read anywhere in the suite is in HOOKS."""
    read = set()
    for path in (ROOT / "peerflow" / "conformance").glob("*.py"):
        read |= set(re.findall(r"""\.hook\(["'](\w+)["']\)""", path.read_text()))
    assert read, "the suite reads hooks through AdapterProfile.hook"
    assert read <= HOOK_NAMES, f"read but not listed: {sorted(read - HOOK_NAMES)}"
    defined = {name for path in (ROOT / "peerflow" / "adapters").rglob("*.py")
               for name in re.findall(r"def (conformance_\w+)\(", path.read_text())}
    assert defined <= HOOK_NAMES, f"defined by an adapter but not listed: {defined - HOOK_NAMES}"


def test_an_unlisted_hook_name_is_refused():
    from peerflow.adapters.hf.engine import HFRolloutEngine

    profile = AdapterProfile.of(HFRolloutEngine)
    assert profile.hook("conformance_read_weights") is not None
    with pytest.raises(KeyError, match="not a conformance hook"):
        profile.hook("conformance_read_everything")
