import pytest

from peerflow.errors import ShardError
from peerflow.shard import Box, ShardPiece, ShardSpec


def test_box_intersection():
    a = Box(offsets=(0, 0), sizes=(4, 4))
    b = Box(offsets=(2, 3), sizes=(4, 4))
    assert a.intersect(b) == Box(offsets=(2, 3), sizes=(2, 1))
    assert a.intersect(Box(offsets=(4, 0), sizes=(1, 4))) is None
    assert str(a.intersect(b)) == "[2:4, 3:4]"


def test_fused_qkv_spec_has_three_pieces():
    hidden, q_rows, kv_rows = 8, 8, 4
    pieces = []
    offset = 0
    for name, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
        half = rows // 2
        pieces.append(ShardPiece(
            name=f"layers.0.self_attn.{name}_proj.weight", global_shape=(rows, hidden),
            global_box=Box(offsets=(0, 0), sizes=(half, hidden)),
            local_box=Box(offsets=(offset, 0), sizes=(half, hidden))))
        offset += half
    spec = ShardSpec(local_name="layers.0.self_attn.qkv_proj.weight", local_shape=(offset, hidden),
                     pieces=pieces)
    assert len(spec.names) == 3 and spec.numel == offset * hidden


def test_out_of_bounds_piece_names_the_parameter():
    with pytest.raises(ShardError, match="embed.weight: box \\[0:5, 0:2\\] lies outside"):
        ShardSpec.of_slice("embed.weight", (4, 2), Box(offsets=(0, 0), sizes=(5, 2)))
    with pytest.raises(ShardError, match="different sizes"):
        ShardPiece(name="w", global_shape=(4,), global_box=Box(offsets=(0,), sizes=(2,)),
                   local_box=Box(offsets=(0,), sizes=(3,)))
