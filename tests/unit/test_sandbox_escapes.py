"""The escape suite against every sandbox; escapes score nothing and the run goes on."""

from __future__ import annotations

import json
import os

import pytest

from peerflow.algorithms.base import Example
from peerflow.config import load_config, validate_config
from peerflow.rewards import build_reward_set
from peerflow.rewards.model_code import FALLBACK_MISSES
from peerflow.sandbox import SandboxUnavailableError, configure
from peerflow.sandbox.audit_hook import AuditHookSandbox
from peerflow.sandbox.bubblewrap import BubblewrapSandbox, bwrap_unavailable
from peerflow.sandbox.config import SandboxConfig
from peerflow.sandbox.escapes import ESCAPED, escape_programs, escape_targets, run_escape_suite
from peerflow.sandbox.remote import RemoteSandbox
from peerflow.sandbox.server import make_server, serve_in_thread

needs_bwrap = pytest.mark.skipif(bwrap_unavailable() is not None,
                                 reason=f"{bwrap_unavailable()}")
#: What the audit-hook fallback lets through on a machine like ours (root in a container):
#: the program keeps the trainer's user, so as root it is the host's root.
FALLBACK_ESCAPES = {"fork_exec a shell that writes outside", "read a secret from /proc/*/environ",
                    "read the dataset by absolute path", "read the reward file by absolute path",
                    "fchmod its host-side stdout"} | ({
                        "run as the host's root", "read a root-only /proc file"}
                        if os.geteuid() == 0 else set())


def _escaped(outcomes) -> set[str]:
    return {o.name for o in outcomes if not o.held}


@needs_bwrap
def test_bubblewrap_contains_every_escape():
    with escape_targets() as targets:
        outcomes = run_escape_suite(BubblewrapSandbox(), targets)
    assert len(outcomes) == 18
    assert not _escaped(outcomes), [(o.name, o.detail) for o in outcomes if not o.held]


def test_the_fallback_lets_through_what_its_warning_says():
    with escape_targets() as targets:
        outcomes = run_escape_suite(AuditHookSandbox(), targets)
    assert _escaped(outcomes) == FALLBACK_ESCAPES
    warning = " ".join(FALLBACK_MISSES)
    for named in ("_posixsubprocess.fork_exec", "/proc/*/environ", "the dataset",
                  "the reward code"):
        assert named in warning


@needs_bwrap
def test_escapes_score_zero_through_the_code_reward_and_the_run_goes_on(plugin_manager,
                                                                       monkeypatch):
    monkeypatch.setenv("PEERFLOW_SANDBOX", "")  # restored after the test
    configure(SandboxConfig(backend="bubblewrap"))
    config = load_config(None, ["task.reward=code", "task.reward_limits.timeout_s=60"])
    validate_config(config, plugin_manager)
    rewards = build_reward_set(config.task, plugin_manager, "char_match")
    tests = json.dumps([{"input": "", "output": ESCAPED}])
    with escape_targets() as targets:
        candidates = [*escape_programs(targets).values(), f"print({ESCAPED!r})"]
        examples = [Example(prompt="escape", answer=tests, index=i)
                    for i in range(len(candidates))]
        try:
            out = rewards.score(candidates, examples)
        finally:
            rewards.close()
        assert not (targets.outside / "fork_exec.txt").exists() and not targets.connections
    assert out.total == [0.0] * (len(candidates) - 1) + [1.0]  # the honest one still scores
    assert out.counts == {"reward/errors": 0, "reward/timeouts": 0}  # failures, not faults


@needs_bwrap
@pytest.mark.parametrize("program, status, expected", [
    ("while True:\n    pass", "timeout", ""),
    ("x = bytearray(2 * 2**30)", "error", "MemoryError"),
    ("import os\nprint(sorted(os.environ))", "ok",
     "['HOME', 'LANG', 'PATH', 'PWD', 'PYTHONHASHSEED']"),
    ("import os\nprint(os.getuid(), os.getgid(), sorted(os.listdir('/proc'))[:2])", "ok",
     "65534 65534 ['1', '2']"),
    ("open('/usr/x', 'w')", "error", "Read-only file system"),
    ("import site", "ok", ""),
    ("import attrs", "error", "No module named 'attrs'"),  # nothing of the trainer's env
])
def test_bubblewrap_limits_and_view(program, status, expected):
    limits = BubblewrapSandbox().run(program, "", None)
    assert limits.status == status and expected in limits.stdout + limits.stderr


@needs_bwrap
def test_output_floods_stop_at_the_file_size_limit():
    from peerflow.sandbox import SandboxLimits

    flood = BubblewrapSandbox().run("while True:\n    print('x' * 4096)", "",
                                    SandboxLimits(timeout_s=5, max_output_mb=1))
    assert flood.status == "error" and len(flood.stdout) <= 2**20


@needs_bwrap
def test_packages_are_importable_only_when_allowed():
    program = "import numpy\nprint(numpy.arange(4).sum())"
    assert BubblewrapSandbox().run(program).status == "error"
    allowed = BubblewrapSandbox().run(program, packages=["numpy"])
    assert allowed.status == "ok" and allowed.stdout == "6\n"
    with pytest.raises(ValueError, match="no module 'no_such_pkg' is installed"):
        BubblewrapSandbox().run(program, packages=["no_such_pkg"])


@needs_bwrap
def test_the_remote_seam_runs_the_suite_through_a_local_service():
    server = make_server(BubblewrapSandbox(), token="s3cret")
    serve_in_thread(server)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        remote = RemoteSandbox(url, "s3cret")
        result = remote.run("import sys\nprint(sys.stdin.read()[::-1])", "abc")
        assert (result.status, result.stdout, result.process_limit) == ("ok", "cba\n", "remote")
        with escape_targets() as targets:
            assert not _escaped(run_escape_suite(remote, targets))
        with pytest.raises(SandboxUnavailableError, match="401"):
            RemoteSandbox(url, "wrong").run("print(1)")
        with pytest.raises(SandboxUnavailableError, match="cannot import"):
            remote.run("print(1)", packages=["numpy"])
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(SandboxUnavailableError, match="did not answer"):
        RemoteSandbox(url).run("print(1)")


def test_validate_refuses_model_code_without_bubblewrap(plugin_manager, monkeypatch):
    import peerflow.rewards.model_code as validate
    from peerflow.errors import ConfigError

    missing = "bubblewrap (`bwrap`) is not installed: install bubblewrap (`apt-get install"
    monkeypatch.setattr(validate, "bwrap_unavailable", lambda: missing + " bubblewrap`)")
    with pytest.raises(ConfigError, match=r"task.reward=code runs model-written code") as err:
        validate_config(load_config(None, ["task.reward=code"]), plugin_manager)
    assert "apt-get install bubblewrap" in str(err.value)
    validate_config(load_config(None, []), plugin_manager)  # no model-written code: fine
    fallback = load_config(None, ["task.reward=code", "sandbox.backend=audit-hook"])
    validate_config(fallback, plugin_manager)
    assert "fork_exec" in validate.fallback_notice(fallback, plugin_manager)
    assert validate.fallback_notice(load_config(None, []), plugin_manager) is None
    with pytest.raises(ConfigError, match="sandbox.url"):
        validate_config(load_config(None, ["sandbox.backend=remote"]), plugin_manager)
    with pytest.raises(ConfigError, match="no module 'nope' is installed"):
        validate_config(load_config(None, ["sandbox.packages=[nope]"]), plugin_manager)


def test_config_validate_names_the_fix_where_bwrap_is_missing(tmp_path):
    import subprocess
    import sys

    bindir = tmp_path / "bin"  # a PATH with the interpreter and no bwrap
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bindir)}
    command = [sys.executable, "-m", "peerflow", "config", "validate", "examples/quickstart.yaml",
               "--set", "task.reward=code"]
    refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode != 0 and "apt-get install bubblewrap" in refused.stderr
    warned = subprocess.run([*command, "--set", "sandbox.backend=audit-hook"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert warned.returncode == 0, warned.stderr
    assert "warning: sandbox.backend=audit-hook" in warned.stderr and "ok" in warned.stdout


def test_a_bubblewrap_that_cannot_disable_user_namespaces_fails_closed(monkeypatch):
    """An old bubblewrap (< 0.8) refuses --disable-userns: the sandbox is then unavailable,
    naming the fix, instead of running programs that may nest user namespaces."""
    import shutil
    import tempfile
    from pathlib import Path

    import peerflow.sandbox.bubblewrap as bubblewrap

    real = shutil.which("bwrap")
    if real is None:
        pytest.skip("bubblewrap is not installed")
    bindir = Path(tempfile.mkdtemp(dir="/tmp"))  # searchable by the sandbox's own uid
    bindir.chmod(0o755)
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, **kw: str(bindir / name)
                        if name == "bwrap" else which(name, **kw))
    old = bindir / "bwrap"  # what bubblewrap 0.7 answers, then the real one otherwise
    old.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = --disable-userns ] && '
                   f'{{ echo "bwrap: Unknown option --disable-userns" >&2; exit 1; }}; done\n'
                   f'exec {real} "$@"\n')
    old.chmod(0o755)
    for cached in (bubblewrap.bwrap_path, bubblewrap.bwrap_unavailable):
        cached.cache_clear()
    try:
        why = bubblewrap.bwrap_unavailable()
        assert why is not None and "Unknown option --disable-userns" in why
        assert "bubblewrap >= 0.8" in why and "sandbox.backend=remote" in why
        with pytest.raises(SandboxUnavailableError, match="--disable-userns"):
            BubblewrapSandbox().run("print(1)")
    finally:
        monkeypatch.undo()
        shutil.rmtree(bindir)
        for cached in (bubblewrap.bwrap_path, bubblewrap.bwrap_unavailable):
            cached.cache_clear()
