"""Optional libraries a setting needs, checked at `peerflow config validate`.

A setting whose library is absent fails validation naming the setting and the extra to
install (`pip install 'peerflow[lora]'`), before any process starts; nothing is imported
(`importlib.util.find_spec`). The engines name their own packages (`EngineBase.requires`,
`install_hint`); the rest are listed here.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from peerflow.config.tracking import tracker_problems
from peerflow.errors import UnknownNameError

_KINDS = {"rollout": "rollout_engine", "trainer": "train_engine"}


def installed(module: str) -> bool:
    """Whether top-level `module` can be imported here (without importing it)."""
    return importlib.util.find_spec(module) is not None


def missing_extra(setting: str, module: str, extra: str, fix: str) -> str | None:
    """The message for `setting` when `module` (from `peerflow[extra]`) is absent, else `None`.

    Args:
        setting: The setting as the user wrote it (`trainer.lora`, `--launcher ray`).
        module: The top-level module it imports (`peft`).
        extra: PeerFlow's extra that installs it (`lora`).
        fix: The other way out (`or remove trainer.lora`).
    """
    if installed(module):
        return None
    return (f"{setting} needs the {module} package, which is not installed: pip install "
            f"'peerflow[{extra}]' ({fix}).")


def engine_problems(config: Any, pm: Any) -> list[str]:
    """The selected rollout and train engines whose packages are absent."""
    problems = []
    for side, kind in _KINDS.items():
        backend = getattr(config, side).backend
        try:
            cls = pm.get(kind, backend)
        except UnknownNameError:  # reported by the name check
            continue
        missing = cls.missing_requirements()
        if missing:
            problems.append(f"{side}.backend={backend!r} needs {', '.join(missing)}, which "
                            f"is not installed: {cls.install_hint}.")
    return problems


def launcher_problem(launcher: str) -> str | None:
    """`--launcher ray` without Ray installed, else `None`."""
    if launcher != "ray":
        return None
    return missing_extra("--launcher ray", "ray", "ray", "or use the default --launcher elastic")


def component_problems(config: Any, pm: Any) -> list[str]:
    """The selected task and agent environment whose libraries are absent.

    A task or environment class declares them as `requires` (top-level modules) and
    `extra` (PeerFlow's extra that installs them), e.g. `reasoning-gym`'s
    `requires = ("reasoning_gym",)`, `extra = "reasoning-gym"`; `install_hint`, when set,
    replaces `pip install 'peerflow[extra]'` (OpenEnv and verifiers install in two steps).
    """
    selected = [("task.name", "task", config.task.name)]
    if config.rollout.agent is not None:
        selected.append(("rollout.agent.environment", "environment",
                         config.rollout.agent.environment))
    problems = []
    for setting, kind, name in selected:
        try:
            cls = pm.get(kind, name)
        except UnknownNameError:  # reported by the name check
            continue
        for module in getattr(cls, "requires", ()):
            problem = missing_extra(f"{setting}={name!r}", module,
                                    getattr(cls, "extra", name), f"or choose another {kind}")
            hint = getattr(cls, "install_hint", "")
            if problem and hint:  # a library installed in more than one step
                problem = (f"{setting}={name!r} needs the {module} package, which is not "
                           f"installed: {hint}.")
            problems += [problem] if problem else []
    return problems


def dependency_problems(config: Any, pm: Any) -> list[str]:
    """Every setting of `config` whose optional library is not installed, one message each."""
    problems = (engine_problems(config, pm) + tracker_problems(config.run)
                + component_problems(config, pm))
    lora = config.trainer.lora and missing_extra(
        "trainer.lora", "peft", "lora", "or remove trainer.lora to train every weight")
    return problems + ([lora] if lora else [])
