"""`peerflow plugins`: what is installed, what it registered, and what failed to load."""

from __future__ import annotations

import argparse
import json
from typing import Any

from peerflow.cli.options import add_json_flag

HELP = "list installed plugins, what they register, and load errors"
DESCRIPTION = ("List every plugin found through the `peerflow` entry-point group: "
               "distribution, version, hooks it implements, the names it registers (engines "
               "marked installed or not), and plugins that failed to load.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `--json` and `--verbose`."""
    add_json_flag(parser, "print machine-readable JSON")
    parser.add_argument("--verbose", action="store_true", help="show load-error tracebacks")


def collect() -> dict[str, Any]:
    """Returns the report `peerflow plugins --json` prints."""
    from peerflow.plugins import KINDS, get_plugin_manager

    pm = get_plugin_manager()
    for key in KINDS:
        pm.registry(key)
    engines = []
    for key in ("rollout_engine", "train_engine"):
        for name, entry in sorted(pm.registry(key).entries.items()):
            missing = entry.cls.missing_requirements()
            engines.append({
                "kind": key, "name": name, "installed": not missing, "missing": list(missing),
                "install_hint": entry.cls.install_hint, "plugin": entry.plugin,
                "distribution": entry.distribution,
                "capabilities": entry.cls.capabilities.enabled(),
                "class": f"{entry.cls.__module__}.{entry.cls.__qualname__}",
            })
    plugins = [
        {"name": r.name, "distribution": r.distribution, "version": r.version,
         "module": r.module, "hooks": r.hooks, "registered": r.registered}
        for r in sorted(pm.records.values(), key=lambda r: (r.distribution, r.name))
    ]
    errors = [
        {"distribution": e.distribution, "entry_point": e.entry_point,
         "exception": e.exception, "traceback": e.traceback}
        for e in pm.load_errors
    ]
    return {"plugins": plugins, "engines": engines, "errors": errors}


def run(args: argparse.Namespace) -> int:
    """Prints the plugin report."""
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    table = Table(title="PeerFlow plugins")
    for column in ("plugin", "distribution", "version", "registers"):
        table.add_column(column)
    for p in report["plugins"]:
        registers = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(p["registered"].items()))
        table.add_row(p["name"], p["distribution"], p["version"], registers or "-")
    console.print(table)
    engines = Table(title="Engines")
    for column in ("kind", "name", "installed", "capabilities / install"):
        engines.add_column(column)
    for e in report["engines"]:
        detail = ", ".join(e["capabilities"]) if e["installed"] else e["install_hint"]
        engines.add_row(e["kind"], e["name"], "yes" if e["installed"] else "no", escape(detail))
    console.print(engines)
    for e in report["errors"]:
        console.print(f"[red]failed to load[/red] {escape(e['entry_point'])} from "
                      f"{escape(e['distribution'])}: {escape(e['exception'])}",
                      highlight=False, soft_wrap=True)
        if args.verbose:
            console.print(e["traceback"], markup=False, highlight=False)
    return 0
