"""`peerflow sandbox check|serve`: prove the sandbox on this machine; serve it over HTTP."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING

from peerflow.cli.options import add_json_flag

if TYPE_CHECKING:
    from peerflow.sandbox.config import SandboxConfig
    from peerflow.sandbox.escapes import EscapeOutcome

BACKEND_HELP = "the sandbox to use (default: bubblewrap, the one runs use by default)"


HELP = "check the code sandbox on this machine, or serve it over HTTP"
DESCRIPTION = ("Model-written code (the `code` reward, agent tools) runs in a sandbox "
               "(docs/rewards.md). `check` runs the escape suite against it and prints what "
               "held; `serve` answers Sandbox Fusion's POST /run_code from it, for "
               "sandbox.backend=remote.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the actions `check` and `serve`."""
    sub = parser.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="run the escape suite; exit 1 if anything escaped")
    check.add_argument("--backend", choices=("bubblewrap", "audit-hook", "remote"),
                       default="bubblewrap", help=BACKEND_HELP)
    check.add_argument("--url", help="with --backend remote: the service's base URL")
    check.add_argument("--token-env", help="with --backend remote: the variable holding "
                       "its bearer token")
    add_json_flag(check, "print JSON instead of a table")
    check.set_defaults(func=run_check)
    serve = sub.add_parser("serve", help="answer POST /run_code from this machine's sandbox")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind, IPv4 or IPv6 "
                       "(default: loopback)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--backend", choices=("bubblewrap", "audit-hook"), default="bubblewrap",
                       help=BACKEND_HELP)
    serve.add_argument("--token-env", help="environment variable holding the bearer token "
                       "every request must carry (default: a fresh token, printed or "
                       "written to --token-file)")
    serve.add_argument("--token-file", help="write the fresh token to this file (mode 0600) "
                       "instead of printing it")
    serve.add_argument("--max-timeout", type=float, default=60.0, metavar="S",
                       help="most seconds a program may run (default 60)")
    serve.add_argument("--max-memory-mb", type=int, default=4096, metavar="MB",
                       help="most memory a program may use (default 4096)")
    serve.add_argument("--workers", type=int, default=None, metavar="N",
                       help="programs run at once; more wait, then get 503 (default: CPUs)")
    serve.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB",
                       help="largest request body (default 16)")
    serve.add_argument("--read-timeout", type=float, default=10.0, metavar="S",
                       help="seconds a request has to arrive whole (default 10)")
    serve.set_defaults(func=run_serve)


def run_check(args: argparse.Namespace) -> int:
    """Runs the escape suite against one sandbox; 0 when every escape was contained.

    It first prints who a program is: the uid map it reads inside and, seen from this
    host's `/proc`, the uid it runs as here (`peerflow.sandbox.identity`).
    """
    from peerflow.sandbox import build
    from peerflow.sandbox.base import SandboxUnavailableError
    from peerflow.sandbox.config import SandboxConfig
    from peerflow.sandbox.escapes import escape_targets, run_escape_suite
    from peerflow.sandbox.identity import sandbox_identity
    from peerflow.sandbox.seccomp_filter import seccomp_status

    config = SandboxConfig(backend=args.backend, url=args.url, token_env=args.token_env)
    sandbox = build(config)
    unavailable = type(sandbox).unavailable()
    if unavailable:
        print(f"error: {unavailable}", file=sys.stderr)
        return 2
    try:
        identity = sandbox_identity(sandbox)
    except SandboxUnavailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with escape_targets() as targets:
        outcomes = run_escape_suite(sandbox, targets, identity)
    outcomes += _forgery_outcomes(config)
    if args.json:
        print(json.dumps({"backend": args.backend, "uid_map_inside": identity.inside_map,
                          "uid_inside": identity.inside_uid,
                          "host_uids": identity.host_uids, "meaning": identity.meaning(),
                          "seccomp": seccomp_status() if args.backend == "bubblewrap" else None,
                          "escapes": [{"name": o.name, "held": o.held, "detail": o.detail}
                                      for o in outcomes]}, indent=2))
    else:
        width = max(len(o.name) for o in outcomes)
        print(f"sandbox: {args.backend}")
        print(f"uid map inside: {identity.inside_map or '(not read)'}")
        print(f"  {identity.meaning()}")
        if args.backend == "bubblewrap":
            print(seccomp_status())
        for o in outcomes:
            print(f"  {'held   ' if o.held else 'ESCAPED'}  {o.name:<{width}}  {o.detail}")
        escaped = sum(not o.held for o in outcomes)
        print(f"{len(outcomes) - escaped} of {len(outcomes)} escapes contained")
    return 0 if all(o.held for o in outcomes) else 1


def _forgery_outcomes(config: SandboxConfig) -> list[EscapeOutcome]:
    """The `code` reward forgeries (`peerflow.rewards.forgeries`) scored in `config`'s sandbox.

    Held: the honest right answer scores 1, the wrong one and every forgery 0.
    """
    from peerflow.rewards.code import code_reward
    from peerflow.rewards.forgeries import score_forgeries
    from peerflow.sandbox.escapes import EscapeOutcome
    from peerflow.sandbox.settings import ENV_VAR, configure

    before = os.environ.get(ENV_VAR)
    configure(config)
    try:
        scores = score_forgeries(lambda programs, examples: [
            code_reward(p, e)["score"] for p, e in zip(programs, examples)])
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before
    return [EscapeOutcome(name=f"reward: {name}", held=score == float(name == "right"),
                          detail=f"scored {score:.2f} (must be {float(name == 'right'):.2f})")
            for name, score in scores.items()]


def run_serve(args: argparse.Namespace) -> int:
    """Serves POST /run_code until interrupted (every request needs the token)."""
    from peerflow.errors import ConfigError
    from peerflow.sandbox import build
    from peerflow.sandbox.base import SandboxLimits
    from peerflow.sandbox.config import SandboxConfig
    from peerflow.sandbox.server import ServeLimits, make_server

    token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not token:
        raise ConfigError(f"--token-env {args.token_env}: that variable is not set; export "
                          "the token first (or leave --token-env out for a fresh one)")
    try:
        limits = ServeLimits(
            cap=SandboxLimits(timeout_s=_positive("--max-timeout", args.max_timeout),
                              memory_mb=int(_positive("--max-memory-mb", args.max_memory_mb))),
            workers=args.workers or ServeLimits().workers,
            max_body_bytes=int(_positive("--max-body-mb", args.max_body_mb) * (1 << 20)),
            read_timeout_s=_positive("--read-timeout", args.read_timeout))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    sandbox = build(SandboxConfig(backend=args.backend))
    unavailable = type(sandbox).unavailable()
    if unavailable:
        raise ConfigError(unavailable)
    try:
        server = make_server(sandbox, args.host, args.port, token, limits)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc}") from None
    print(f"peerflow sandbox: serving POST {server.url}/run_code ({args.backend}, "
          f"{limits.workers} workers, at most {limits.cap.timeout_s:g} s and "
          f"{limits.cap.memory_mb} MB a program); Ctrl-C stops", flush=True)
    if token is None:
        _announce_token(server.token, args.token_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _positive(flag: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} {value}: must be a finite number > 0")
    return float(value)


def _announce_token(token: str, path: str | None) -> None:
    """Prints a fresh token, or writes it to `path` (mode 0600, never through a link)."""
    how = "export PEERFLOW_SANDBOX_TOKEN={} and set sandbox.token_env: PEERFLOW_SANDBOX_TOKEN"
    if path is None:
        print(f"token (every request needs it): {token}\n  on the client: "
              + how.format(token), flush=True)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    print(f"token written to {path} (mode 0600)\n  on the client: "
          + how.format(f"$(cat {path})"), flush=True)
