"""`cuda_ipc`'s receiver refuses what a peer (or anyone posing as one) sends it (issue 49).

The protocol on host memory, as `test_reshard_shards` runs it: rank 0 plays a hostile
sender and writes, on the transport's own tags, a bucket header naming a slot past the
table, one naming bytes of a storage never mapped, or a valid header followed by a
crafted pickle where the CUDA IPC export belongs. Rank 1's `exchange` raises
`WireFormatError` each time; the pickle's marker file never appears (the receiver
unpickled exports before issue 49).
"""

from __future__ import annotations

import os
import pickle

import pytest

from tests.helpers.gloo import run_gloo
from tests.helpers.hostile import Payload

pytestmark = pytest.mark.distributed

CASES = ("slot", "unmapped", "pickle")


def _hostile(rank: int, world: int) -> dict[str, str]:
    import torch
    import torch.distributed as dist

    from peerflow.reshard.cuda_ipc import EXPORT, HEADER, CudaIpcTransport
    from peerflow.wirecodec import WireFormatError

    export = pickle.dumps(Payload(os.environ["PEERFLOW_TEST_MARKER"]))
    headers = {"slot": [9, 0, 64, 0], "unmapped": [0, 0, 64, 0],
               "pickle": [0, 0, 64, len(export)]}
    got = {}
    for case in CASES:
        if rank == 0:
            works = [dist.isend(torch.tensor(headers[case]), dst=1, tag=HEADER)]
            if case == "pickle":
                works.append(dist.isend(torch.frombuffer(bytearray(export), dtype=torch.uint8),
                                        dst=1, tag=EXPORT))
            for work in works:
                work.wait()
        else:
            transport = CudaIpcTransport(rank=1)
            transport.timeout = 30
            try:
                transport.exchange({}, {0: 64}, [])
                got[case] = "accepted"
            except WireFormatError as exc:
                got[case] = str(exc)
        dist.barrier()
    return got


def test_forged_headers_and_a_pickled_export_are_refused(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("PEERFLOW_TEST_MARKER", str(marker))
    got = run_gloo(_hostile, 2, timeout_s=60)[1]
    assert "slot 9" in got["slot"] and "at most 4 slots" in got["slot"]
    assert "not mapped" in got["unmapped"]
    assert "malformed CUDA IPC export from rank 0" in got["pickle"]
    assert not marker.exists()
