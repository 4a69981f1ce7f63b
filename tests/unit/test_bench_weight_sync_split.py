"""`peerflow bench weight-sync --split` refuses to run outside torchrun, saying how."""

from __future__ import annotations

import argparse

import pytest

from peerflow.bench import weight_sync


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    weight_sync.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_split_outside_torchrun_names_the_command(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = _args("--split")
    assert (args.dtype, args.lr, args.backend) == ("bfloat16", 1e-6, None)
    with pytest.raises(SystemExit, match="torchrun --nproc-per-node 2 -m peerflow bench"):
        weight_sync.run(args)


def test_split_measures_one_known_size(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="one size"):
        weight_sync.run(_args("--split", "--sizes", "quickstart,500m"))
