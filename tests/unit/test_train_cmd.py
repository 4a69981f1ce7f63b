from __future__ import annotations

import argparse

import pytest

from peerflow.cli import build_parser
from peerflow.cli.train_cmd import resolve_paths
from peerflow.errors import ConfigError


def parse(*argv):
    return build_parser().parse_args(["train", *argv])


def test_parser_has_every_option():
    args = parse("cfg.yaml", "--nprocs", "4", "--run-dir", "d", "--launcher", "ray",
                 "--set", "a=1", "--set", "b.c=2")
    assert (args.config, args.nprocs, args.run_dir, args.launcher) == ("cfg.yaml", 4, "d", "ray")
    assert args.overrides == ["a=1", "b.c=2"]


def test_resume_uses_the_saved_config(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    assert resolve_paths(parse("--resume", str(tmp_path))) == (
        str(tmp_path / "config.yaml"), str(tmp_path))


def test_resume_of_a_non_run_directory_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_paths(parse("--resume", str(tmp_path)))


def test_resume_and_other_run_dir_disagree(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    with pytest.raises(ConfigError, match="disagree"):
        resolve_paths(parse("--resume", str(tmp_path), "--run-dir", str(tmp_path / "x")))


def test_no_config_is_an_error():
    with pytest.raises(ConfigError, match="give a config file"):
        resolve_paths(argparse.Namespace(resume=None, config=None, run_dir=None))


def test_fresh_run_dir_is_left_to_the_run():
    assert resolve_paths(parse("cfg.yaml")) == ("cfg.yaml", None)
