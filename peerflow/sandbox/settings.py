"""Which sandbox a process uses: chosen once from the run's `sandbox` section.

The worker calls `configure(config.sandbox)` at start; the choice travels in the
environment variable `PEERFLOW_SANDBOX`, so the processes a worker starts (reward pool
workers, forked or spawned) make the same choice. `current()` returns that sandbox (the
default `bubblewrap` where nothing was configured: a direct `run_sandboxed` call gets the
strong one or a clear error, never the weak one by surprise).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

import attrs

from peerflow.sandbox.audit_hook import AuditHookSandbox
from peerflow.sandbox.base import Sandbox, SandboxLimits, SandboxResult
from peerflow.sandbox.bubblewrap import BubblewrapSandbox
from peerflow.sandbox.config import SandboxConfig
from peerflow.sandbox.remote import RemoteSandbox

ENV_VAR = "PEERFLOW_SANDBOX"
BACKENDS: dict[str, type[Sandbox]] = {
    cls.name: cls for cls in (BubblewrapSandbox, AuditHookSandbox, RemoteSandbox)}


def configure(config: SandboxConfig) -> None:
    """Makes `config` the choice of this process and of every process it starts."""
    os.environ[ENV_VAR] = json.dumps(attrs.asdict(config), sort_keys=True)


def settings() -> SandboxConfig:
    """The configured settings (the defaults when `configure` was not called)."""
    raw = os.environ.get(ENV_VAR)
    return SandboxConfig(**json.loads(raw)) if raw else SandboxConfig()


def build(config: SandboxConfig) -> Sandbox:
    """The sandbox `config` selects.

    Raises:
        SandboxUnavailableError: `remote` without a URL or with an unset token variable.
    """
    if config.backend == "remote":
        return RemoteSandbox.from_settings(config.url, config.token_env)
    return BACKENDS[config.backend]()


@functools.cache
def _cached(raw: str | None) -> Sandbox:
    return build(SandboxConfig(**json.loads(raw)) if raw else SandboxConfig())


def current() -> Sandbox:
    """The sandbox of this process (`configure`, else bubblewrap)."""
    return _cached(os.environ.get(ENV_VAR))


def run_sandboxed(program: str, stdin: str = "", limits: SandboxLimits | None = None,
                  packages: Sequence[str] = ()) -> SandboxResult:
    """Runs `program` in this process's sandbox (`Sandbox.run`), with `sandbox.packages`.

    Every code path that runs model-written code calls this: the `code` reward, the agents'
    tools; an environment library's code execution that PeerFlow starts goes through it too.
    """
    allowed = [*settings().packages, *packages]
    return current().run(program, stdin, limits, tuple(dict.fromkeys(allowed)))
