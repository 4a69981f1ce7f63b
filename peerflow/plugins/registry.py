"""Name registries: map what a config names (`rollout.backend: vllm`) to a class."""

from __future__ import annotations

import difflib
from typing import Any

import attrs

from peerflow.errors import DuplicateNameError, UnknownNameError


@attrs.frozen(kw_only=True)
class Kind:
    """One kind of registered class and the hook that fills its registry.

    Every kind has exactly one hookspec, written out in `peerflow.plugins.hookspecs`
    under the name `hook` (`tests/unit/test_hookspecs.py` checks both ways).
    """

    key: str
    """Registry key, e.g. `rollout_engine`."""
    hook: str
    """The `peerflow_register_*` hook that fills it."""
    label: str
    """Human name used in messages, e.g. `rollout backend`."""
    config_key: str
    """Where a config selects one, e.g. `rollout.backend`."""
    base: str
    """Dotted path of the base class every entry must subclass."""


KINDS: dict[str, Kind] = {
    k.key: k
    for k in (
        Kind(key="rollout_engine", hook="peerflow_register_rollout_engines",
             label="rollout backend", config_key="rollout.backend",
             base="peerflow.engines.RolloutEngine"),
        Kind(key="train_engine", hook="peerflow_register_train_engines",
             label="trainer backend", config_key="trainer.backend",
             base="peerflow.engines.TrainEngine"),
        Kind(key="weight_transport", hook="peerflow_register_weight_transports",
             label="weight transport", config_key="weight_sync.transport",
             base="peerflow.reshard.WeightTransport"),
        Kind(key="reward", hook="peerflow_register_rewards", label="reward",
             config_key="task.reward", base="peerflow.algorithms.RewardFunction"),
        Kind(key="advantage_estimator", hook="peerflow_register_advantage_estimators",
             label="advantage estimator", config_key="algorithm.advantage",
             base="peerflow.algorithms.AdvantageEstimator"),
        Kind(key="policy_loss", hook="peerflow_register_policy_losses",
             label="policy loss", config_key="algorithm.loss",
             base="peerflow.algorithms.PolicyLoss"),
        Kind(key="task", hook="peerflow_register_tasks", label="task",
             config_key="task.name", base="peerflow.algorithms.Task"),
        Kind(key="node", hook="peerflow_register_nodes", label="workflow node type",
             config_key="workflow.nodes[].kind", base="peerflow.workflow.NodeType"),
        Kind(key="sampler", hook="peerflow_register_samplers", label="sampler",
             config_key="runtime.sampler", base="peerflow.streaming.samplers.Sampler"),
        Kind(key="environment", hook="peerflow_register_environments",
             label="agent environment", config_key="rollout.agent.environment",
             base="peerflow.agents.Environment"),
        Kind(key="tool", hook="peerflow_register_tools", label="agent tool",
             config_key="rollout.agent.options.tools", base="peerflow.agents.tools.Tool"),
    )
}


@attrs.frozen(kw_only=True)
class Entry:
    """A registered class and the plugin that registered it."""

    cls: type
    plugin: str
    distribution: str


def _base_class(path: str) -> type | None:
    if not path:
        return None
    module, _, name = path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@attrs.define(eq=False)
class Registry:
    """The classes of one kind, by name."""

    kind: Kind
    entries: dict[str, Entry] = attrs.field(factory=dict)
    skipped: str = ""
    """Why third-party entry points were not loaded (set by the plugin manager when
    `PEERFLOW_DISABLE_PLUGIN_AUTOLOAD` or `PEERFLOW_PLUGINS` kept some out), else empty."""
    load_errors: tuple[str, ...] = ()
    """The plugins that failed to load or to register, each as `distribution: entry point:
    exception` (set by the plugin manager): what they would register is missing."""

    def register(self, cls: Any, *, plugin: str, distribution: str) -> None:
        """Adds `cls` under `cls.name`.

        Raises:
            PluginError: `cls` has no string `name` or is not a subclass of the kind's base.
            DuplicateNameError: another plugin already registered that name.
        """
        from peerflow.errors import PluginError

        name = getattr(cls, "name", None)
        if not isinstance(cls, type) or not isinstance(name, str) or not name:
            raise PluginError(
                f"plugin {plugin!r} ({distribution}) registered {cls!r} as a {self.kind.label} "
                "without a string class attribute `name`; set `name = \"…\"` on the class."
            )
        base = _base_class(self.kind.base)
        if base is not None and not issubclass(cls, base):
            raise PluginError(
                f"plugin {plugin!r} ({distribution}) registered {_qualname(cls)} as a "
                f"{self.kind.label}, but it does not subclass {self.kind.base}."
            )
        existing = self.entries.get(name)
        if existing is not None and existing.cls is not cls:
            raise DuplicateNameError(
                f"two plugins register the {self.kind.label} {name!r}: "
                f"{_qualname(existing.cls)} (plugin {existing.plugin!r}, distribution "
                f"{existing.distribution}) and {_qualname(cls)} (plugin {plugin!r}, "
                f"distribution {distribution}); uninstall one of them or rename a class."
            )
        self.entries[name] = Entry(cls=cls, plugin=plugin, distribution=distribution)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def get(self, name: str) -> type:
        """Returns the class registered as `name`.

        Raises:
            UnknownNameError: listing the registered names, with each one's install hint
                where its engine is missing, and a did-you-mean.
        """
        entry = self.entries.get(name)
        if entry is not None:
            return entry.cls
        raise UnknownNameError(self.unknown_message(name))

    def unknown_message(self, name: str) -> str:
        """The message of the error `get(name)` raises."""
        lines = [f"unknown {self.kind.label} {name!r} ({self.kind.config_key})."]
        if self.skipped:
            lines = [f"{self.kind.label} {name!r} is not registered because {self.skipped}"]
        close = difflib.get_close_matches(name, self.names(), n=1)
        if close:
            lines[0] += f" Did you mean {close[0]!r}?"
        if self.entries:
            lines.append(f"Registered {self.kind.label}s:")
            for known, entry in sorted(self.entries.items()):
                missing = getattr(entry.cls, "missing_requirements", lambda: ())()
                hint = getattr(entry.cls, "install_hint", "")
                status = f"not installed: {hint}" if missing else "installed"
                lines.append(f"  {known:<12} {status}  [{entry.distribution}]")
        else:
            lines.append(f"No {self.kind.label} is registered.")
        if self.load_errors:
            lines.append(f"{len(self.load_errors)} plugin(s) failed to load, so what they "
                         "register is missing; fix or uninstall them (`peerflow plugins "
                         "--verbose` shows the tracebacks):")
            lines.extend(f"  {error}" for error in self.load_errors)
        else:
            lines.append(
                "Third-party plugins are found through the `peerflow` entry-point group: "
                "`pip install` the package that provides it, then check `peerflow plugins`."
            )
        return "\n".join(lines)
