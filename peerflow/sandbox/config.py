"""The `sandbox` section: where model-written code runs (`peerflow.sandbox`)."""

from __future__ import annotations

from typing import Literal

import attrs


@attrs.frozen(kw_only=True)
class SandboxConfig:
    """Where model-written programs run: the `code` reward, agent tools, environments."""

    backend: Literal["bubblewrap", "audit-hook", "remote"] = "bubblewrap"
    """`bubblewrap`: each program in its own namespaces as an unprivileged user, seeing a
    read-only `/usr`, the standard library and its own directory (needs the `bwrap` tool;
    `config validate` refuses a task that runs model-written code without it);
    `audit-hook`: the weaker fallback (a subprocess with an audit hook; it does not stop
    reads of the dataset, the reward code or other processes' secrets, nor processes
    started by calls that raise no audit event; every run that uses it says so);
    `remote`: a `run_code` HTTP service at `sandbox.url` (Sandbox Fusion's API, or
    `peerflow sandbox serve`). See docs/rewards.md for the threat model."""
    packages: list[str] = attrs.field(factory=list)
    """Installed top-level modules programs may import besides the standard library
    (read-only), e.g. `[numpy]`; a tool's own package is added for its calls."""
    url: str | None = None
    """`remote`: the service's base URL (`{url}/run_code` is posted to)."""
    token_env: str | None = None
    """`remote`: the environment variable holding its bearer token (never the token in
    the config file)."""
