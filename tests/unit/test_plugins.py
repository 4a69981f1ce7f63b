import json

import pytest

from peerflow.engines import RolloutEngine
from peerflow.errors import DuplicateNameError, UnknownNameError
from peerflow.plugins import hookimpl
from tests.helpers.fake_dist import make_distribution, run_peerflow
from tests.helpers.plugins import registering

BUILTIN_ENGINES = {"rollout_engine": {"hf", "vllm", "sglang"},
                   "train_engine": {"fsdp", "deepspeed", "megatron"}}

GOOD_PLUGIN = '''
from peerflow.plugins import hookimpl
from peerflow.algorithms import RewardFunction

class LengthReward(RewardFunction):
    name = "length"
    def score(self, responses, examples):
        return [float(len(r)) for r in responses]

@hookimpl
def peerflow_register_rewards(register):
    register(LengthReward)
'''


def test_builtin_engines_register_even_when_not_installed(plugin_manager):
    for kind, names in BUILTIN_ENGINES.items():
        registry = plugin_manager.registry(kind)
        assert names <= set(registry.names()), (kind, registry.names())
        for name in names:
            assert registry.entries[name].distribution == "peerflow"


def test_loading_is_idempotent(plugin_manager):
    before = dict(plugin_manager.records)
    plugin_manager.load_entry_points()
    plugin_manager.load_entry_points()
    assert plugin_manager.records.keys() == before.keys()


def test_duplicate_names_are_an_error_naming_both(plugin_manager):
    class ShadowHF(RolloutEngine):
        name = "hf"

        def generate(self, requests, sampling):
            return []

        def weight_targets(self):
            return []

        def load_weights(self, items):
            pass

    plugin = registering("peerflow_register_rollout_engines", ShadowHF)
    plugin_manager.register(plugin, "shadow", distribution="shadow-dist")
    with pytest.raises(DuplicateNameError) as info:
        plugin_manager.registry("rollout_engine")
    message = str(info.value)
    assert "ShadowHF" in message and "shadow-dist" in message
    assert "HFRolloutEngine" in message and "peerflow" in message


def test_unknown_name_lists_installed_names_and_extras(plugin_manager):
    with pytest.raises(UnknownNameError) as info:
        plugin_manager.get("rollout_engine", "vllmm")
    message = str(info.value)
    assert "Did you mean 'vllm'?" in message
    for name in BUILTIN_ENGINES["rollout_engine"]:
        assert name in message
    assert "pip install 'peerflow[sglang]'" in message


def test_registering_a_class_without_name_is_reported(plugin_manager):
    from peerflow.errors import PluginError

    class Nameless:
        pass

    plugin_manager.register(registering("peerflow_register_rewards", Nameless), "nameless")
    with pytest.raises(PluginError, match="without a string class attribute `name`"):
        plugin_manager.registry("reward")


def _plugins_json(tmp_path, env=None):
    result = run_peerflow("plugins", "--json", pythonpath=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_plugin_that_raises_on_import_is_reported_and_others_load(tmp_path):
    make_distribution(tmp_path, "broken-plugin",
                      {"broken_mod": "raise RuntimeError('boom on import')"},
                      {"broken": "broken_mod"})
    make_distribution(tmp_path, "good-plugin", {"good_mod": GOOD_PLUGIN}, {"good": "good_mod"})
    report = _plugins_json(tmp_path)
    (error,) = [e for e in report["errors"] if "broken" in e["entry_point"]]
    assert error["distribution"].startswith("broken-plugin")
    assert error["entry_point"] == "broken = broken_mod"
    assert "RuntimeError: boom on import" in error["exception"]
    good = [p for p in report["plugins"] if p["name"] == "good"]
    assert good and good[0]["registered"] == {"reward": ["length"]}
    assert {e["name"] for e in report["engines"]} >= {"hf", "fsdp"}
    table = run_peerflow("plugins", pythonpath=tmp_path)
    assert table.returncode == 0 and "boom on import" in table.stdout


def test_autoload_can_be_disabled_or_allow_listed(tmp_path):
    make_distribution(tmp_path, "good-plugin", {"good_mod": GOOD_PLUGIN}, {"good": "good_mod"})
    make_distribution(tmp_path, "other-plugin", {"other_mod": "raise ImportError('x')"},
                      {"other": "other_mod"})
    names = lambda report: {p["name"] for p in report["plugins"]}  # noqa: E731
    disabled = _plugins_json(tmp_path, {"PEERFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"})
    third_party_errors = lambda report: [e for e in report["errors"]  # noqa: E731
                                         if e["distribution"].startswith("other-plugin")]
    assert "good" not in names(disabled) and not third_party_errors(disabled)
    assert "hf" in names(disabled), "built-in entry points always load"
    allowed = _plugins_json(tmp_path, {"PEERFLOW_PLUGINS": "good"})
    assert "good" in names(allowed) and not third_party_errors(allowed)
    both = _plugins_json(tmp_path, {"PEERFLOW_DISABLE_PLUGIN_AUTOLOAD": "1",
                                    "PEERFLOW_PLUGINS": "good"})
    assert "good" in names(both)


def test_unknown_name_with_autoload_disabled_blames_the_environment_variable(tmp_path):
    make_distribution(tmp_path, "good-plugin", {"good_mod": GOOD_PLUGIN}, {"good": "good_mod"})
    result = run_peerflow("conformance", "toy", pythonpath=tmp_path,
                          env={"PEERFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.returncode == 1
    assert "rollout backend 'toy' is not registered because " \
        "PEERFLOW_DISABLE_PLUGIN_AUTOLOAD is set" in result.stderr, result.stderr
    assert "good (good-plugin" in result.stderr and "PEERFLOW_PLUGINS=good" in result.stderr


def test_misspelled_hook_is_an_error_naming_plugin_and_hook():
    from peerflow.errors import PluginError
    from peerflow.plugins.manager import PluginManager

    class Typo:
        @hookimpl
        def peerflow_register_reward(self, register):
            raise AssertionError("never called")

    pm = PluginManager()
    with pytest.raises(PluginError, match=r"'typo-plugin'.*'peerflow_register_reward'.*"
                                          r"Did you mean 'peerflow_register_rewards'"):
        pm.register(Typo(), "typo-plugin")
    assert "typo-plugin" not in pm.records and not pm.pm.has_plugin("typo-plugin")


def test_core_registers_samplers_and_validators_like_a_plugin(plugin_manager):
    assert {"sequential", "grouped", "length_balanced"} <= set(
        plugin_manager.registry("sampler").names())
    for module in ("peerflow.streaming.samplers", "peerflow.planner.validate",
                   "peerflow.rewards.setup", "peerflow.worker.nodes"):
        assert plugin_manager.records[module].distribution == "peerflow"


def test_the_core_registers_its_own_agent_features(monkeypatch):
    """`tools`, `agent-program` and `calculator` are core features: they do not depend on
    the first-party content plugin (`peerflow.contrib.tasks.plugin`) being installed."""
    import importlib.metadata

    from peerflow.plugins.manager import PluginManager

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    pm = PluginManager()
    pm.load_entry_points()  # the core plugins only: no entry point is found
    assert {"tools", "agent-program"} <= set(pm.registry("environment").names())
    assert "calculator" in pm.registry("tool").names()
    assert "reverse-digits" not in pm.registry("task").names()  # content stays a plugin
