"""`peerflow sandbox check|serve`: prove the sandbox on this machine; serve it over HTTP."""

from __future__ import annotations

import argparse
import json
import os
import sys

from peerflow.cli.options import add_json_flag

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
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: "
                       "loopback; anything else requires --token-env)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--backend", choices=("bubblewrap", "audit-hook"), default="bubblewrap",
                       help=BACKEND_HELP)
    serve.add_argument("--token-env", help="environment variable holding the bearer token "
                       "every request must carry")
    serve.set_defaults(func=run_serve)


def run_check(args: argparse.Namespace) -> int:
    """Runs the escape suite against one sandbox; 0 when every escape was contained."""
    from peerflow.sandbox import build
    from peerflow.sandbox.config import SandboxConfig
    from peerflow.sandbox.escapes import escape_targets, run_escape_suite

    sandbox = build(SandboxConfig(backend=args.backend, url=args.url,
                                  token_env=args.token_env))
    unavailable = type(sandbox).unavailable()
    if unavailable:
        print(f"error: {unavailable}", file=sys.stderr)
        return 2
    with escape_targets() as targets:
        outcomes = run_escape_suite(sandbox, targets)
    if args.json:
        print(json.dumps({"backend": args.backend, "escapes": [
            {"name": o.name, "held": o.held, "detail": o.detail} for o in outcomes]}, indent=2))
    else:
        width = max(len(o.name) for o in outcomes)
        print(f"sandbox: {args.backend}")
        for o in outcomes:
            print(f"  {'held   ' if o.held else 'ESCAPED'}  {o.name:<{width}}  {o.detail}")
        escaped = sum(not o.held for o in outcomes)
        print(f"{len(outcomes) - escaped} of {len(outcomes)} escapes contained")
    return 0 if all(o.held for o in outcomes) else 1


def run_serve(args: argparse.Namespace) -> int:
    """Serves POST /run_code until interrupted."""
    from peerflow.errors import ConfigError
    from peerflow.sandbox import build
    from peerflow.sandbox.config import SandboxConfig
    from peerflow.sandbox.server import make_server

    token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not token:
        raise ConfigError(f"--token-env {args.token_env}: that variable is not set; export "
                          "the token first")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not token:
        raise ConfigError(f"--host {args.host} exposes code execution beyond this machine: "
                          "give --token-env VAR with a secret token in VAR")
    sandbox = build(SandboxConfig(backend=args.backend))
    unavailable = type(sandbox).unavailable()
    if unavailable:
        raise ConfigError(unavailable)
    server = make_server(sandbox, args.host, args.port, token)
    host, port = server.server_address[:2]
    print(f"peerflow sandbox: serving POST http://{host}:{port}/run_code "
          f"({args.backend}{', token required' if token else ''}); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
