"""The pieces of `peerflow export`: assembling HF tensors from checkpoint shards, and the
HF directory writer refusing weights that do not fit the architecture."""

from __future__ import annotations

import pytest
import torch

from peerflow.engines import SavedShard
from peerflow.errors import ShardError
from peerflow.hf_export import assemble_hf_tensors, write_model_dir
from peerflow.shard import Box, ShardSpec

FULL = torch.arange(24, dtype=torch.float32).reshape(6, 4)


def _rows(name: str, rows: range, *, source: int, replica: int = 0) -> SavedShard:
    box = Box(offsets=(rows.start, 0), sizes=(len(rows), 4))
    spec = ShardSpec.of_slice(name, FULL.shape, box, replica=replica)
    return SavedShard(source=source, spec=spec, read=lambda: FULL[rows].clone())


def test_shards_of_two_ranks_and_a_replica_assemble_exactly():
    shards = [_rows("w", range(0, 4), source=0), _rows("w", range(4, 6), source=1),
              _rows("w", range(0, 6), source=2, replica=1)]  # a copy: never read
    out = assemble_hf_tensors(shards)
    assert torch.equal(out["w"], FULL)
    assert assemble_hf_tensors(shards, dtype=torch.bfloat16)["w"].dtype == torch.bfloat16


def test_a_missing_region_or_a_wrong_saved_shape_is_refused_by_name():
    with pytest.raises(ShardError, match="w"):
        assemble_hf_tensors([_rows("w", range(0, 4), source=0)])
    bad = SavedShard(source=0, spec=ShardSpec.of_slice("w", FULL.shape),
                     read=lambda: torch.zeros(4, 6))
    with pytest.raises(ShardError, match=r"'w' \(part 0\) has shape \(4, 6\)"):
        assemble_hf_tensors([bad])


def test_the_writer_refuses_weights_of_another_architecture(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=True)
    tensors = {"model.embed_tokens.weight": torch.zeros(16, 8), "model.norm.weight": torch.ones(9)}
    with pytest.raises(ShardError) as info:
        write_model_dir(tmp_path / "out", tensors, config=config)
    message = str(info.value)
    assert "model.norm.weight weights [9], architecture [8]" in message
    assert "only in the architecture: model.layers.0." in message
    assert "lm_head" not in message  # tied
    assert not (tmp_path / "out").exists()


def test_peerflow_export_stays_the_function_after_its_package_is_imported():
    import peerflow
    import peerflow.hf_export  # noqa: F401  (a submodule import must not shadow the API)

    assert callable(peerflow.export) and peerflow.export.__module__ == "peerflow.api"
