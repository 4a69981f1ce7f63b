"""An unknown name names the plugins that failed to load, with their exception (issue 40)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peerflow.errors import UnknownNameError
from peerflow.plugins import hookimpl
from peerflow.plugins.manager import PluginManager
from tests.helpers.fake_dist import make_distribution, run_peerflow

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


class _BrokenRegistration:
    """A plugin whose hook raises while registering its engine."""

    @hookimpl
    def peerflow_register_rollout_engines(self, register):
        raise ModuleNotFoundError("No module named 'my_kernels'")


def test_unknown_backend_names_the_plugin_whose_hook_failed():
    pm = PluginManager()
    pm.register(_BrokenRegistration(), "my-engine", distribution="my-engine-dist")
    with pytest.raises(UnknownNameError) as info:
        pm.get("rollout_engine", "my-engine")
    message = str(info.value)
    assert "1 plugin(s) failed to load" in message
    assert ("my-engine-dist: entry point my-engine (peerflow_register_rollout_engines): "
            "ModuleNotFoundError: No module named 'my_kernels'") in message
    assert "`pip install` the package" not in message  # it is installed: it is broken


def test_unknown_task_names_the_entry_point_that_failed_to_import(tmp_path):
    make_distribution(tmp_path, "broken-plugin",
                      {"broken_mod": "raise RuntimeError('boom on import')"},
                      {"broken": "broken_mod"})
    result = run_peerflow("config", "validate", str(QUICKSTART), "--set", "task.name=nope",
                          pythonpath=tmp_path)
    assert result.returncode == 1
    assert "unknown task 'nope' (task.name)" in result.stderr, result.stderr
    assert "broken-plugin 1.0: entry point broken = broken_mod: RuntimeError: boom on import" \
        in result.stderr, result.stderr
