"""Nothing a rank receives is unpickled (issue 49, break 5): the attacks, then the codec.

Each attack hands a receiver's decode path — a packed batch's header
(`coordinator.wire.unpack_batch`), a streaming payload (`streaming.transport.
decode_payload`, the trainer's seal reports and patches), a CUDA IPC export
(`reshard.ipc_handles.open_export`) — a pickle whose `__reduce__` runs `touch MARKER`
(`tests.helpers.hostile.Payload`). Before issue 49 each of them called `pickle.loads`
and the file appeared; the fixture unpickles the same bytes once to show they are live.
"""

from __future__ import annotations

import enum
import pickle

import attrs
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peerflow.batch import Batch, RaggedField
from peerflow.coordinator.wire import pack_batch, unpack_batch
from peerflow.errors import WorkerFailedError
from peerflow.reshard.ipc_handles import export_storage, open_export
from peerflow.streaming.transport import StreamReceiver, decode_payload, encode_payload
from peerflow.wirecodec import DTYPE, MAX_DEPTH, WireFormatError, decode, encode, register
from tests.helpers.hostile import Payload


@pytest.fixture
def crafted(tmp_path):
    """`(pickle bytes, marker path)`; the control proves unpickling them plants the marker."""
    marker = tmp_path / "pwned"
    data = pickle.dumps(Payload(marker))
    pickle.loads(data)
    assert marker.exists()
    marker.unlink()
    return data, marker


def _message(header: bytes) -> torch.Tensor:
    """A packed-batch message framed around `header` as `pack_batch` frames one."""
    total = 16 * (2 + (len(header) + 15) // 16)
    out = torch.zeros(total, dtype=torch.uint8)
    out[:16] = torch.tensor([total, len(header)], dtype=torch.int64).view(torch.uint8)
    out[16:16 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    return out


def test_a_pickled_batch_header_is_refused_not_unpickled(crafted):
    data, marker = crafted
    with pytest.raises(WireFormatError, match="batch header.*never unpickles"):
        unpack_batch(_message(data))
    assert not marker.exists()


def test_a_pickled_streaming_payload_is_refused_not_unpickled(crafted):
    data, marker = crafted
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    with pytest.raises(WireFormatError, match="seal report from rank 3"):
        decode_payload(payload, "seal report from rank 3")
    assert not marker.exists()


def test_a_pickled_cuda_ipc_export_is_refused_not_unpickled(crafted):
    data, marker = crafted
    with pytest.raises(WireFormatError, match="CUDA IPC export from rank 1"):
        open_export(data, peer=1)
    assert not marker.exists()


def _batch() -> Batch:
    batch = Batch(sample_id=torch.arange(3), group_id=torch.tensor([0, 0, 1]),
                  weight_version=torch.zeros(3, dtype=torch.int64))
    batch.set("response_ids", RaggedField.from_tensors(
        [torch.arange(2), torch.arange(5), torch.arange(1)], dtype=torch.int64))
    batch.set("reward", torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16))
    batch.set("hidden", torch.randn(3, 2, 4))
    batch.set_objects("example", [
        {"question": "1+1?", "answer": ("2", 2), "tags": None, 7: b"\x00\xff"},
        {"nested": [{"a": [1.5, True]}], "big": 10**30, "np": np.float64(0.25)},
        {"text": "caf\u00e9 \ud800"}])
    return batch


def _same(a: Batch, b: Batch) -> bool:
    (meta_a, ta), (meta_b, tb) = a.to_wire(), b.to_wire()
    return meta_a == meta_b and all(x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(ta, tb))


def test_a_packed_batch_round_trips_byte_exact_with_every_kind_of_field():
    batch = _batch()
    got = unpack_batch(pack_batch(batch))
    assert _same(got, batch)
    assert got["example"][0]["answer"] == ("2", 2) and got["example"][0][7] == b"\x00\xff"
    assert type(got["example"][1]["np"]) is np.float64


def _tampered(change) -> torch.Tensor:
    """A valid packed batch whose decoded header `change(header)` edited, re-encoded."""
    packed = pack_batch(_batch())
    size = int(packed[8:16].clone().view(torch.int64)[0])
    header = decode(packed[16:16 + size].numpy().tobytes())
    change(header)
    return _message(encode(header))  # a `msgpack.ExtType` in it is packed as it is


TAMPERINGS = {
    "a dtype torch lacks": lambda h: h["tensors"][0].__setitem__(0, "system"),
    "a dtype as a tagged value": lambda h: h["tensors"][0].__setitem__(0, torch.int64),
    "a negative shape": lambda h: h["tensors"][3].__setitem__(1, [-4]),
    "a tensor past the message": lambda h: h["tensors"][3].__setitem__(1, [10**9]),
    "an unknown field kind": lambda h: h["layout"].append(["x", "pickle"]),
    "an object field not in the layout": lambda h: h["objects"].__setitem__("y", [1]),
    "a missing tensor": lambda h: h["tensors"].pop(),
    "an unknown type code": lambda h: h.__setitem__("layout", msgpack.ExtType(99, b"")),
    "a forbidden dtype tag": lambda h: h.__setitem__("layout", msgpack.ExtType(DTYPE, b"os")),
    "ids of different lengths": lambda h: h["tensors"][1].__setitem__(1, [2]),
    "an extra key": lambda h: h.__setitem__("reduce", "os.system"),
    "an empty shape past int64": lambda h: h["tensors"][0].__setitem__(1, [0, 10**30]),
    "an empty shape whose strides overflow": lambda h: h["tensors"][0].__setitem__(
        1, [0, 2**62, 2**62]),
}


@pytest.mark.parametrize("change", TAMPERINGS.values(), ids=TAMPERINGS.keys())
def test_a_tampered_header_is_refused_before_any_byte_is_sliced(change):
    with pytest.raises(WireFormatError, match="malformed"):
        unpack_batch(_tampered(change))


@pytest.mark.parametrize("prefix", [(10**12, 40), (64, 10**9), (64, 0), (8, 4)],
                         ids=["message length", "header length", "empty header", "short"])
def test_a_tampered_prefix_is_refused(prefix):
    packed = pack_batch(_batch())
    packed[:16] = torch.tensor(prefix, dtype=torch.int64).view(torch.uint8)
    with pytest.raises(WireFormatError, match="malformed"):
        unpack_batch(packed)


def _reframed(change) -> torch.Tensor:
    """A valid packed batch whose header `change(header)` edited, its tensor bytes kept."""
    packed = pack_batch(_batch())
    size = int(packed[8:16].clone().view(torch.int64)[0])
    header = decode(packed[16:16 + size].numpy().tobytes())
    change(header)
    data = encode(header)
    body = packed[(16 + size + 15) // 16 * 16:]
    start = (16 + len(data) + 15) // 16 * 16
    out = torch.zeros(start + body.numel(), dtype=torch.uint8)
    out[:16] = torch.tensor([out.numel(), len(data)], dtype=torch.int64).view(torch.uint8)
    out[16:16 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out[start:] = body
    return out


#: Headers whose tensors all fit the message but describe no batch: a ragged field's
#: values (tensor 3) or offsets (tensor 4) that do not go together. Before, each gave a
#: batch that raised IndexError (or sliced with floats) wherever it was used.
COLUMNS = {
    "empty offsets": lambda h: h["tensors"][4].__setitem__(1, [0]),
    "float offsets": lambda h: h["tensors"][4].__setitem__(0, "float64"),
    "2-d offsets": lambda h: h["tensors"][4].__setitem__(1, [2, 2]),
    "offsets past the values": lambda h: h["tensors"][3].__setitem__(1, [0]),
}


@pytest.mark.parametrize("change", COLUMNS.values(), ids=COLUMNS.keys())
def test_a_header_describing_no_batch_is_refused(change):
    assert len(unpack_batch(_reframed(lambda h: None))) == 3  # the frame is right
    with pytest.raises(WireFormatError, match="malformed"):
        unpack_batch(_reframed(change))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_corrupted_header_bytes_give_a_batch_or_a_wire_format_error(data):
    packed = pack_batch(_batch())
    size = int(packed[8:16].clone().view(torch.int64)[0])
    for _ in range(data.draw(st.integers(1, 4))):
        packed[data.draw(st.integers(16, 15 + size))] = data.draw(st.integers(0, 255))
    try:
        unpack_batch(packed)
    except WireFormatError:
        pass


class Color(enum.IntEnum):
    RED = 1


@register
@attrs.frozen(kw_only=True)
class Score:
    name: str
    value: float = attrs.field(validator=attrs.validators.ge(0.0))


@attrs.frozen
class Unregistered:
    x: int


def test_the_type_table_round_trips_and_subclasses_travel_as_their_base():
    value = {"t": (1, (2, "x")), "d": torch.float8_e4m3fn, "tensor": torch.arange(6).view(2, 3),
             "empty": torch.empty(0, 2), "arr": np.arange(4, dtype=np.int16).reshape(2, 2),
             "score": Score(name="f1", value=0.5), "enum": Color.RED, "size": torch.Size([2])}
    got = decode(encode(value))
    assert got["t"] == (1, (2, "x")) and got["d"] is torch.float8_e4m3fn
    assert torch.equal(got["tensor"], value["tensor"]) and got["empty"].shape == (0, 2)
    assert np.array_equal(got["arr"], value["arr"]) and got["arr"].dtype == np.int16
    assert got["score"] == Score(name="f1", value=0.5)
    assert type(got["enum"]) is int and got["size"] == (2,)


def test_a_value_outside_the_table_fails_at_the_sender_naming_the_fix():
    with pytest.raises(TypeError, match="Unregistered.*register its attrs class"):
        encode([Unregistered(1)])
    with pytest.raises(TypeError, match="builtins.set"):
        encode({1, 2})


def _nested(depth: int) -> bytes:
    value: object = 1
    for _ in range(depth):
        value = (value,)
    return encode(value)


REFUSED = {
    "an unregistered attrs name": msgpack.packb(msgpack.ExtType(6, msgpack.packb(
        ["os.system", {"command": "touch /tmp/x"}]))),
    "a registered class failing its validator": encode(Score(name="f1", value=0.5)).replace(
        msgpack.packb(0.5), msgpack.packb(-1.0)),
    "an object numpy dtype": msgpack.packb(msgpack.ExtType(4, msgpack.packb(
        ["|O", [1], b"\0" * 8, False], use_bin_type=True))),
    "tensor bytes disagreeing with the shape": msgpack.packb(msgpack.ExtType(3, msgpack.packb(
        ["float32", [4], b"\0" * 15], use_bin_type=True))),
    "trailing bytes": encode([1, 2]) + b"\x00",
    "a tuple nested too deep": _nested(MAX_DEPTH + 1),
    "arrays nested past msgpack's stack": b"\x91" * 100_000 + b"\x00",
}


@pytest.mark.parametrize("data", REFUSED.values(), ids=REFUSED.keys())
def test_the_decoder_refuses_what_the_table_does_not_build(data):
    with pytest.raises(WireFormatError, match="never unpickles"):
        decode(data)


def test_a_streaming_report_and_patch_round_trip():
    report = {"busy": 1.5, "idle": 0.25, "version": 3, "skipped_versions": [1, 2]}
    patch = [(7, "reward", torch.tensor([1.0, 2.0]), "ragged"), (8, "judge", {"ok": True}, "auto")]
    assert decode_payload(encode_payload(report)) == report
    got = decode_payload(encode_payload(patch))
    assert got[0][:2] == (7, "reward") and torch.equal(got[0][2], patch[0][2])
    assert got[1] == patch[1]


def test_a_host_export_maps_the_same_memory_in_the_receiver(monkeypatch):
    """The `host` kind end to end in one process: the mapped storage is the sender's."""
    import torch.multiprocessing

    monkeypatch.setattr(torch.multiprocessing, "get_sharing_strategy", lambda: "file_system")
    buf = torch.zeros(64, dtype=torch.uint8).share_memory_()
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(buf.untyped_storage(), 0, (64,), (1,))
    mapped = open_export(export_storage(whole), peer=0)
    buf[5] = 42
    assert mapped.numel() == 64 and int(mapped[5]) == 42


def test_a_cuda_export_is_rebuilt_by_the_function_the_receiver_picks(monkeypatch):
    """A CUDA handle tuple (`_share_cuda_`'s eight values) travels as plain values.

    Opening a real handle needs a GPU (the GPU kit's `cuda_ipc_pair` does); here the call
    torch's rebuild receives is recorded: the receiver's own function, class and dtype,
    whatever the peer sent.
    """
    import torch.multiprocessing.reductions as reductions

    calls = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: calls.append(a) or "t")
    values = [0, b"\x01" * 64, 4096, 512, b"/torch_1_2_3", 8, b"\x02" * 64, True]
    assert open_export(encode({"kind": "cuda", "values": values}), peer=2) == "t"
    (args,) = calls
    assert args[0] is torch.Tensor and args[4] is torch.storage.TypedStorage
    assert args[1:4] == ((4096,), (1,), 0) and args[5] is torch.uint8
    assert list(args[6:10]) + list(args[11:]) == values and args[10] is False
    for bad in ([*values[:7], "yes"], [-1, *values[1:]], values[:7]):
        with pytest.raises(WireFormatError, match="malformed CUDA IPC export from rank 2"):
            open_export(encode({"kind": "cuda", "values": bad}), peer=2)
    with pytest.raises(WireFormatError, match="malformed"):
        open_export(encode({"kind": "pickle", "values": values}), peer=2)


class _ForgedHeaders(StreamReceiver):
    """A receiver whose peer sends `HEADER` as its message header (no process group)."""

    HEADER = (99, 0, 0, 0)

    def _recv(self, tensor, src):
        tensor.copy_(torch.tensor(self.HEADER, dtype=torch.int64))


@pytest.mark.parametrize("header", [(99, 0, 0, 0), (-1, 0, 0, 0)], ids=["kind 99", "kind -1"])
def test_a_streaming_header_of_an_unknown_kind_fails_the_receiver_naming_the_peer(header):
    """The receiver thread died on `Kind(99)` (ValueError), and `get` waited forever."""
    _ForgedHeaders.HEADER = header
    receiver = _ForgedHeaders(sources=(3,), tag=11, timeout=5.0).start()
    with pytest.raises(WorkerFailedError, match="rank 3.*malformed"):
        for _ in range(50):
            receiver.get(timeout=0.1)
