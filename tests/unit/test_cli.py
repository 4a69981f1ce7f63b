import argparse
import importlib
import json
import subprocess
import sys

from peerflow.cli import COMMANDS, build_parser, command_name
from tests.helpers.fake_dist import run_peerflow

ALL_BUILTINS = {"hf", "fsdp", "vllm", "sglang", "deepspeed", "megatron"}


def test_version_and_help():
    version = run_peerflow("--version")
    assert version.returncode == 0 and version.stdout.startswith("peerflow ")
    help_text = run_peerflow("--help")
    assert help_text.returncode == 0
    for command in ("plugins", "config", "bench"):
        assert command in help_text.stdout


def test_every_command_module_is_registered_with_its_help_and_description():
    # build_parser joins each module of COMMANDS the one way (peerflow.cli's docstring)
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    listed = {choice.dest: choice.help for choice in sub._choices_actions}
    assert list(listed) == [command_name(name) for name in COMMANDS]
    for name in COMMANDS:
        module = importlib.import_module(f"peerflow.cli.{name}")
        command = sub.choices[command_name(name)]
        assert listed[command_name(name)] == module.HELP and module.HELP
        assert command.description == module.DESCRIPTION and module.DESCRIPTION
        assert not hasattr(module, "add_parser")
        # one action: its `run`; several: each action's parser sets its own `func`
        assert command.get_default("func") is getattr(module, "run", None)
    assert sub.choices["checkpoints"].parse_args(["r"]).run_dir == "r"


def test_building_the_command_line_imports_no_engine_or_torch():
    # `peerflow --help` and every `COMMAND --help` must not wait for torch (seconds)
    probe = ("import sys; from peerflow.cli import build_parser; build_parser(); "
             "heavy = sorted(m for m in ('torch', 'transformers', 'vllm', 'deepspeed', 'ray') "
             "if m in sys.modules); print(heavy)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_plugins_json_lists_every_builtin_backend():
    result = run_peerflow("plugins", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    engines = {e["name"]: e for e in report["engines"]}
    assert ALL_BUILTINS <= set(engines)
    for name in ALL_BUILTINS:
        assert isinstance(engines[name]["installed"], bool)
        assert engines[name]["distribution"] == "peerflow"
    assert engines["hf"]["installed"] and engines["fsdp"]["installed"]
    assert engines["sglang"]["install_hint"]
    plugin = next(p for p in report["plugins"] if p["name"] == "hf")
    assert plugin["hooks"] == ["peerflow_register_rollout_engines"]
    assert plugin["registered"] == {"rollout_engine": ["hf"]}


def test_config_validate_misspelled_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  lr: 1.0e-3\n  gradclip: 1.0\n")
    result = run_peerflow("config", "validate", str(path))
    assert result.returncode != 0
    assert "trainer.gradclip: unknown key. Did you mean 'grad_clip'?" in result.stderr


def test_config_validate_unknown_backend_lists_installed(tmp_path):
    path = tmp_path / "nosuch.yaml"
    path.write_text("rollout:\n  backend: nosuch\n")
    result = run_peerflow("config", "validate", str(path))
    assert result.returncode != 0
    for name in ("hf", "vllm", "sglang"):
        assert name in result.stderr


def test_config_show_prints_resolved_config(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("trainer:\n  lr: 0.01\n")
    result = run_peerflow("config", "show", str(path), "--set", "rollout.sampling.n=3")
    assert result.returncode == 0, result.stderr
    assert "lr: 0.01" in result.stdout and "n: 3" in result.stdout
    assert "backend: hf" in result.stdout
