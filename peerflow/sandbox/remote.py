"""Sending programs to a sandbox service over HTTP (the Sandbox Fusion `run_code` API).

`sandbox.backend: remote` with `sandbox.url` posts each program to `{url}/run_code` in
the request shape of ByteDance's Sandbox Fusion (the service verl's code rewards use):

    {"code": ..., "language": "python", "stdin": ..., "run_timeout": s,
     "memory_limit_MB": m}  ->  {"status": "Success" | "Failed" | "SandboxError",
                                  "message": ...,
                                  "run_result": {"status": "Finished" | "TimeLimitExceeded"
                                                 | "Error", "return_code": ...,
                                                 "stdout": ..., "stderr": ...}}

so a Sandbox Fusion deployment, or `peerflow sandbox serve` on another machine (which
answers the same route from its own bubblewrap sandbox), is a drop-in. A bearer token is
read from the environment variable `sandbox.token_env` names and sent with every call
(`peerflow sandbox serve` refuses a call without it). A 503 (the service's workers are
busy) is retried after its `Retry-After` until the program's time limit plus `GRACE_S`
has passed; any other refusal is a `SandboxUnavailableError` quoting the service.
The service applies its own isolation; a program sent there imports only what the
service has (`packages` cannot be shipped, so a call that names some is refused).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any, ClassVar

from peerflow.sandbox.base import Sandbox, SandboxLimits, SandboxResult, SandboxUnavailableError

#: Seconds the service gets beyond the program's own time limit to answer.
GRACE_S = 30.0


def result_from_reply(reply: dict[str, Any]) -> SandboxResult:
    """A `SandboxResult` from a `run_code` reply.

    Raises:
        SandboxUnavailableError: when the service reports its own failure.
    """
    run = reply.get("run_result") or {}
    if reply.get("status") == "SandboxError" or not run:
        raise SandboxUnavailableError(
            f"the sandbox service failed: {reply.get('message') or reply!r}"[:2000])
    returncode = run.get("return_code")
    if run.get("status") == "TimeLimitExceeded":
        status = "timeout"
    else:
        status = "ok" if run.get("status") == "Finished" and returncode == 0 else "error"
    return SandboxResult(status=status, returncode=returncode,
                         stdout=run.get("stdout") or "", stderr=run.get("stderr") or "",
                         network_isolated=True, process_limit="remote")


class RemoteSandbox(Sandbox):
    """A `run_code` HTTP service (see the module docstring)."""

    name: ClassVar[str] = "remote"

    def __init__(self, url: str, token: str | None = None) -> None:
        """Args: url: the service's base URL; token: a bearer token, or `None`."""
        self.url = url.rstrip("/")
        self.token = token

    @classmethod
    def from_settings(cls, url: str | None, token_env: str | None) -> RemoteSandbox:
        """From `sandbox.url` and `sandbox.token_env` (the variable must be set if named)."""
        if not url:
            raise SandboxUnavailableError("sandbox.backend=remote needs sandbox.url (the "
                                          "service's base URL, e.g. http://host:8080)")
        token = None
        if token_env:
            token = os.environ.get(token_env)
            if not token:
                raise SandboxUnavailableError(
                    f"sandbox.token_env={token_env!r}, but that environment variable is not "
                    "set in this process; export it before starting the run")
        return cls(url, token)

    def run(self, program: str, stdin: str = "", limits: SandboxLimits | None = None,
            packages: Sequence[str] = ()) -> SandboxResult:
        """Runs one program (see `Sandbox.run`)."""
        limits = limits or SandboxLimits()
        if packages:
            raise SandboxUnavailableError(
                f"the remote sandbox cannot import this environment's packages {list(packages)}"
                "; install them on the service, or use sandbox.backend=bubblewrap")
        body = json.dumps({"code": program, "language": "python", "stdin": stdin,
                           "run_timeout": limits.timeout_s,
                           "memory_limit_MB": limits.memory_mb}).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        deadline = time.monotonic() + limits.timeout_s + GRACE_S
        while True:
            request = urllib.request.Request(f"{self.url}/run_code", data=body,
                                             headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=max(
                        1.0, deadline - time.monotonic())) as answer:
                    reply = json.loads(answer.read())
                return result_from_reply(reply)
            except urllib.error.HTTPError as exc:
                wait = _retry_after(exc)
                if exc.code != 503 or time.monotonic() + wait >= deadline:
                    raise SandboxUnavailableError(_refusal(self.url, exc)) from exc
                time.sleep(wait)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                raise SandboxUnavailableError(
                    f"the sandbox service at {self.url} did not answer: {exc}") from exc


def _retry_after(error: urllib.error.HTTPError) -> float:
    """Seconds a 503 asks the client to wait (its `Retry-After`, 0.1 to 5 s)."""
    try:
        return min(5.0, max(0.1, float(error.headers.get("Retry-After", 1))))
    except (TypeError, ValueError):
        return 1.0


def _refusal(url: str, error: urllib.error.HTTPError) -> str:
    """The service's refusal, with its own message when it sent one."""
    try:
        message = json.loads(error.read()).get("message") or ""
    except (OSError, ValueError, AttributeError):
        message = ""
    hint = (" (sandbox.token_env must name the variable holding the token the service "
            "printed or was given)" if error.code == 401 else "")
    return (f"the sandbox service at {url} refused the call: HTTP {error.code} "
            f"{error.reason}{': ' + message if message else ''}{hint}")[:2000]
