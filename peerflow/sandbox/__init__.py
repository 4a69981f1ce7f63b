"""Running model-written code: one sandbox per run, real isolation by default.

`run_sandboxed(program, stdin, limits)` runs a Python program in the sandbox the run chose
(`sandbox.backend`): `bubblewrap` (namespaces, an unprivileged user, a read-only view of
only the interpreter; the default), `audit-hook` (the weaker fallback, chosen explicitly)
or `remote` (an HTTP `run_code` service). Every code path that runs model-written code
goes through it: the `code` reward, the agents' tools. `peerflow sandbox check` runs the
escape suite (`peerflow.sandbox.escapes`) and prints what held; docs/rewards.md has the
threat model.
"""

from peerflow.sandbox.base import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailableError,
)
from peerflow.sandbox.settings import build, configure, current, run_sandboxed, settings

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailableError", "build",
           "configure", "current", "run_sandboxed", "settings"]
