"""Loads plugins from the `peerflow` entry-point group and builds the name registries.

Environment:
    PEERFLOW_DISABLE_PLUGIN_AUTOLOAD=1: load no third-party entry point except those
        named in `PEERFLOW_PLUGINS`.
    PEERFLOW_PLUGINS=a,b: allow-list of third-party entry-point names to load.

Entry points of the `peerflow` distribution itself (the built-in adapters and
algorithms) always load: they register exactly like third parties, and a run needs them.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import os
import threading
import traceback
from typing import Any

import attrs
import pluggy

from peerflow.errors import PluginError
from peerflow.plugins import hookspecs
from peerflow.plugins.registry import KINDS, Registry

ENTRY_POINT_GROUP = "peerflow"
BUILTIN_DISTRIBUTION = "peerflow"
#: Core modules that register their built-ins through the same hooks a plugin uses.
CORE_PLUGINS = ("peerflow.streaming.samplers", "peerflow.planner.validate",
                "peerflow.rewards.setup", "peerflow.worker.nodes", "peerflow.training.schedule",
                "peerflow.rewards.model_code", "peerflow.agents.plugin")


@attrs.frozen(kw_only=True)
class PluginLoadError:
    """A plugin that could not be loaded or whose registration hook failed."""

    distribution: str
    """Distribution (pip package) that ships the plugin."""
    entry_point: str
    """`name = module` of the entry point, or the plugin name for hook failures."""
    exception: str
    """`Type: message` of the exception."""
    traceback: str
    """Formatted traceback, for `--verbose` output."""

    def __str__(self) -> str:
        return f"{self.distribution}: entry point {self.entry_point}: {self.exception}"


@attrs.define(kw_only=True)
class PluginRecord:
    """What `peerflow plugins` shows for one loaded plugin."""

    name: str
    distribution: str
    version: str
    module: str
    hooks: list[str] = attrs.field(factory=list)
    registered: dict[str, list[str]] = attrs.field(factory=dict)


def _env_allowlist() -> set[str] | None:
    raw = os.environ.get("PEERFLOW_PLUGINS", "").strip()
    return {n.strip() for n in raw.split(",") if n.strip()} if raw else None


def _autoload_disabled() -> bool:
    return os.environ.get("PEERFLOW_DISABLE_PLUGIN_AUTOLOAD", "").strip() not in ("", "0")


class PluginManager:
    """PeerFlow's pluggy manager plus load-error reporting and registries."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.load_errors: list[PluginLoadError] = []
        self.skipped_entry_points: list[str] = []
        self.records: dict[str, PluginRecord] = {}
        self._registries: dict[str, Registry] | None = None
        self._entry_points_loaded = False
        self._lock = threading.Lock()

    @property
    def hook(self) -> Any:
        """Pluggy's hook relay, for lifecycle calls (`pm.hook.peerflow_end_of_step(...)`)."""
        return self.pm.hook

    def register(
        self, plugin: object, name: str, *, distribution: str = "<python>", version: str = ""
    ) -> None:
        """Registers a plugin object or module directly (tests, notebooks, Python configs).

        Idempotent for the same name. Registries are rebuilt on next access.
        """
        if self.pm.has_plugin(name):
            return
        self.pm.register(plugin, name=name)
        self.check_pending()
        module = getattr(plugin, "__name__", type(plugin).__name__)
        self.records[name] = PluginRecord(
            name=name, distribution=distribution, version=version, module=module,
            hooks=sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()),
        )
        self._registries = None

    def check_pending(self) -> None:
        """Raises `PluginError` for a hook implementation that matches no hookspec.

        Pluggy would otherwise register a misspelled hook silently and never call it.
        """
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            specs = [n for n in vars(hookspecs) if n.startswith(f"{hookspecs.PROJECT}_")]
            bad = [(impl.plugin_name, hook) for hook, caller in vars(self.pm.hook).items()
                   if not hook.startswith("_") and not caller.has_spec()
                   for impl in caller.get_hookimpls()]
            plugin, hook = bad[0]
            self.pm.unregister(name=plugin)
            self.records.pop(plugin, None)
            close = difflib.get_close_matches(hook, specs, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PluginError(
                f"plugin {plugin!r} implements {hook!r}, which is not a PeerFlow hook.{hint} "
                f"Rename the function to one of: {', '.join(sorted(specs))}."
            ) from None

    def unregister(self, name: str) -> None:
        """Removes a plugin registered under `name` (used by tests)."""
        plugin = self.pm.get_plugin(name)
        if plugin is not None:
            self.pm.unregister(plugin, name=name)
        self.records.pop(name, None)
        self._registries = None

    def load_entry_points(self) -> None:
        """Imports and registers every allowed entry point of the `peerflow` group.

        Idempotent. A plugin that raises on import is recorded in `load_errors` with its
        distribution, entry point and exception; the others still load.
        """
        with self._lock:
            if self._entry_points_loaded:
                return
            self._entry_points_loaded = True
            for module in CORE_PLUGINS:
                self.register(importlib.import_module(module), module,
                              distribution=BUILTIN_DISTRIBUTION)
            allow = _env_allowlist()
            disabled = _autoload_disabled()
            seen: set[tuple[str, str]] = set()
            for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                dist = ep.dist.name if ep.dist is not None else "<unknown>"
                version = ep.dist.version if ep.dist is not None else ""
                if (ep.name, ep.value) in seen:
                    continue
                seen.add((ep.name, ep.value))
                builtin = dist == BUILTIN_DISTRIBUTION
                if not builtin and (disabled or allow is not None) and ep.name not in (allow or ()):
                    self.skipped_entry_points.append(f"{ep.name} ({dist} {version})".strip())
                    continue
                try:
                    plugin = ep.load()
                except BaseException as exc:  # noqa: BLE001 - a plugin may raise anything
                    if isinstance(exc, KeyboardInterrupt | SystemExit):
                        raise
                    self.load_errors.append(
                        PluginLoadError(
                            distribution=f"{dist} {version}".strip(),
                            entry_point=f"{ep.name} = {ep.value}",
                            exception=f"{type(exc).__name__}: {exc}",
                            traceback=traceback.format_exc(),
                        )
                    )
                    continue
                self.register(plugin, ep.name, distribution=dist, version=version)

    def _build_registries(self) -> dict[str, Registry]:
        registries = {key: Registry(kind=kind, skipped=self._skipped_note())
                      for key, kind in KINDS.items()}
        for record in self.records.values():
            record.registered = {}
        for key, kind in KINDS.items():
            caller = getattr(self.pm.hook, kind.hook)
            for impl in caller.get_hookimpls():
                record = self.records.get(impl.plugin_name)
                dist = record.distribution if record else "<python>"

                def register(cls: Any, _plugin: str = impl.plugin_name, _dist: str = dist,
                             _key: str = key) -> None:
                    registries[_key].register(cls, plugin=_plugin, distribution=_dist)
                    if _plugin in self.records:
                        self.records[_plugin].registered.setdefault(_key, []).append(cls.name)

                try:
                    impl.function(register=register)
                except PluginError:
                    raise
                except Exception as exc:  # noqa: BLE001 - report and keep the others
                    self.load_errors.append(
                        PluginLoadError(
                            distribution=dist,
                            entry_point=f"{impl.plugin_name} ({kind.hook})",
                            exception=f"{type(exc).__name__}: {exc}",
                            traceback=traceback.format_exc(),
                        )
                    )
        failed = tuple(str(error) for error in self.load_errors)
        for registry in registries.values():
            registry.load_errors = failed
        return registries

    def _skipped_note(self) -> str:
        if not self.skipped_entry_points:
            return ""
        names = ", ".join(self.skipped_entry_points)
        switch = "PEERFLOW_DISABLE_PLUGIN_AUTOLOAD is set" if _autoload_disabled() else \
            f"PEERFLOW_PLUGINS={os.environ.get('PEERFLOW_PLUGINS', '')!r} does not list them"
        first = self.skipped_entry_points[0].split(" ")[0]
        return (f"{switch}, so these installed third-party plugins were not loaded: {names}. "
                f"Unset PEERFLOW_DISABLE_PLUGIN_AUTOLOAD, or allow-list the plugin "
                f"(PEERFLOW_PLUGINS={first},…).")

    def registry(self, kind: str) -> Registry:
        """Returns the registry of one kind (`rollout_engine`, `reward`, …).

        Raises:
            DuplicateNameError: two plugins register the same name.
        """
        if self._registries is None:
            self._registries = self._build_registries()
        return self._registries[kind]

    def get(self, kind: str, name: str) -> type:
        """Shorthand for `registry(kind).get(name)`."""
        return self.registry(kind).get(name)


_MANAGER: PluginManager | None = None
_MANAGER_LOCK = threading.Lock()


def get_plugin_manager(*, autoload: bool = True) -> PluginManager:
    """Returns this process's plugin manager, loading entry points on first use."""
    global _MANAGER
    with _MANAGER_LOCK:
        if _MANAGER is None:
            _MANAGER = PluginManager()
    if autoload:
        _MANAGER.load_entry_points()
    return _MANAGER


def load_plugins() -> PluginManager:
    """Loads plugins in this process (idempotent); every worker calls it at start-up."""
    return get_plugin_manager(autoload=True)


def reset_plugin_manager() -> None:
    """Forgets the process's manager so the next call reloads (tests only)."""
    global _MANAGER
    with _MANAGER_LOCK:
        _MANAGER = None
    importlib.invalidate_caches()
