"""Pieces of the `vllm` adapter that need no running engine: options, shared buffer, names."""

from __future__ import annotations

import os

import pytest
import torch

from peerflow.adapters.vllm.channel import SharedBuffer
from peerflow.adapters.vllm.options import VLLMRolloutOptions
from peerflow.config.structure import structure
from peerflow.errors import ConfigError
from peerflow.models.vllm import split_tp_prefix


def test_options_from_config_and_bad_values_named():
    opts = structure(VLLMRolloutOptions, {"executor": "multiprocess", "max_model_len": 64},
                     "rollout.vllm")
    assert opts.uses_worker_processes and opts.max_model_len == 64
    assert VLLMRolloutOptions(tensor_parallel_size=2).uses_worker_processes
    assert not VLLMRolloutOptions().uses_worker_processes
    with pytest.raises(ConfigError, match="executor"):
        structure(VLLMRolloutOptions, {"executor": "threads"}, "rollout.vllm")
    with pytest.raises(ConfigError, match="max_model_len"):
        structure(VLLMRolloutOptions, {"max_model_len": 0}, "rollout.vllm")


def testsplit_tp_prefix():
    assert split_tp_prefix("tp3/model.norm.weight") == (3, "model.norm.weight")
    assert split_tp_prefix("model.norm.weight") == (0, "model.norm.weight")
    assert split_tp_prefix("tpx/a") == (0, "tpx/a")


def test_shared_buffer_round_trip_and_chunks(tmp_path):
    buf = SharedBuffer.create(str(tmp_path), 4096)
    try:
        a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        b = torch.arange(5, dtype=torch.bfloat16)
        c = torch.ones(1000, dtype=torch.float32)  # 4000 bytes: does not fit after a, b
        chunks = list(buf.chunks([(0, "a", a), (1, "b", b), (0, "c", c)]))
        assert [[name for _, name, _ in chunk] for chunk in chunks] == [["a", "b"], ["c"]]
        layout = buf.write(chunks[0])
        assert [entry[2] % 64 for entry in layout] == [0, 0]
        # A second mapping of the same file (what a worker process opens) sees the bytes.
        other = torch.from_file(buf.path, shared=True, size=buf.nbytes, dtype=torch.uint8)
        assert [(entry[0], entry[1]) for entry in layout] == [(0, "a"), (1, "b")]
        for (_, _, offset, shape, dtype), want in zip(layout, (a, b)):
            n = want.numel() * want.element_size()
            got = other[offset:offset + n].view(getattr(torch, dtype)).view(shape)
            assert torch.equal(got, want)
        with pytest.raises(ValueError, match="shm_bytes"):
            list(buf.chunks([(0, "big", torch.zeros(2048))]))
    finally:
        buf.close()
    assert not os.path.exists(buf.path)
    buf.close()


def test_shared_buffer_needs_a_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="shm_dir"):
        SharedBuffer.create(str(tmp_path / "missing"), 1024)
