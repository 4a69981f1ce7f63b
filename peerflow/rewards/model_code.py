"""Which parts of a run execute model-written code, and whether its sandbox can run here.

`config validate` (before any process starts) refuses a run whose reward or environment
runs model-written code (`runs_model_code`) when `sandbox.backend` cannot run here, naming
the fix; a run on the weaker fallback says so at start (`fallback_notice`).
"""

from __future__ import annotations

from typing import Any

from peerflow.plugins.hookspecs import hookimpl
from peerflow.rewards.setup import parse_target, selected_rewards
from peerflow.sandbox.bubblewrap import bwrap_unavailable
from peerflow.sandbox.local import package_paths

#: What the audit-hook fallback does not stop (the escape suite's findings; its test
#: checks this list against a run of the suite).
FALLBACK_MISSES = (
    "processes started by calls that raise no audit event (_posixsubprocess.fork_exec), "
    "which then write anywhere the trainer's user may and signal any process",
    "reads of any file: the dataset, the reward code, checkpoints",
    "reads of other processes' environments (/proc/*/environ: WANDB_API_KEY, HF_TOKEN, "
    "cloud credentials)",
)


def model_code_runners(config: Any, pm: Any) -> list[str]:
    """The config keys whose component executes model-written code."""
    keys = []
    for key, entry in selected_rewards(config, pm):
        if parse_target(entry.fn) is None and entry.fn in pm.registry("reward"):
            if getattr(pm.get("reward", entry.fn), "runs_model_code", False):
                keys.append(f"{key}={entry.fn}")
    agent = config.rollout.agent
    if agent is not None and agent.environment in pm.registry("environment"):
        if getattr(pm.get("environment", agent.environment), "runs_model_code", False):
            keys.append(f"rollout.agent.environment={agent.environment}")
    return keys


def sandbox_problems(config: Any, pm: Any) -> list[str]:
    """Problems with `sandbox` for this run (empty when its model-written code can run)."""
    settings = config.sandbox
    problems = []
    try:
        package_paths(settings.packages)
    except ValueError as exc:
        problems.append(str(exc))
    if settings.backend == "remote" and not settings.url:
        problems.append("sandbox.backend=remote needs sandbox.url (the base URL of a "
                        "run_code service: Sandbox Fusion, or `peerflow sandbox serve`).")
    runners = model_code_runners(config, pm)
    if runners and settings.backend == "bubblewrap":
        why = bwrap_unavailable()
        if why is not None:
            problems.append(f"{', '.join(runners)} runs model-written code, and "
                            f"sandbox.backend=bubblewrap cannot run here: {why}")
    return problems


def fallback_notice(config: Any, pm: Any) -> str | None:
    """What a run on the audit-hook fallback must say at start; `None` for other runs."""
    runners = model_code_runners(config, pm)
    if config.sandbox.backend != "audit-hook" or not runners:
        return None
    misses = "".join(f"\n  - {miss}" for miss in FALLBACK_MISSES)
    return (f"warning: sandbox.backend=audit-hook: model-written code ({', '.join(runners)}) "
            f"runs in the weaker fallback sandbox, which does not stop:{misses}\n"
            "Install bubblewrap and drop the setting, or use sandbox.backend=remote "
            "(docs/rewards.md; `peerflow sandbox check --backend audit-hook` shows it).")


@hookimpl
def peerflow_validate_config(config: Any, pm: Any) -> list[str]:
    """The sandbox can run the run's model-written code (`sandbox_problems`)."""
    return sandbox_problems(config, pm)
