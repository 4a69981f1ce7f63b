"""Plugins made on the spot in tests."""

from __future__ import annotations

from types import SimpleNamespace

from peerflow.plugins import hookimpl


def registering(hook: str, *classes: type) -> SimpleNamespace:
    """A plugin whose registration hook `hook` (`peerflow_register_*`) registers `classes`."""

    def register_all(register):
        for cls in classes:
            register(cls)

    return SimpleNamespace(**{hook: hookimpl(register_all)})
