"""Point-to-point exchange of self-sized messages: one message per pair, no size message.

Every message is a flat `uint8` tensor whose first 8 bytes hold its own length in bytes
(`int64`, see `frame`). The receiver posts its `irecv` into a buffer of `capacity` bytes
before (or while) the sender sends, and gloo accepts a message shorter than the posted
buffer, so a pair exchanges exactly one message whenever the capacity holds it — no
separate size message and no second round trip. Both sides must agree on the capacity
of each pair: the coordinator derives it from metadata every rank already has (an upper
bound of the packed size) or uses the constant `HEAD_BYTES` when the receiver cannot know
the size. A message longer than its capacity travels as a head of `capacity` bytes plus
a tail on the next tag, which the receiver requests once the head has told it the length.

isend/irecv address global ranks, so no process group is needed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import ClassVar, Protocol

import attrs
import torch
import torch.distributed as dist

from peerflow.distributed.comm import wait_all

#: Capacity of a receive whose size the receiver cannot bound in advance (metadata, the
#: centralized baseline's gather and scatter): larger messages cost a second message.
HEAD_BYTES = 16 * 1024
#: Smallest capacity: room for the length prefix and some payload.
MIN_CAPACITY = 64


class ExchangeChannel(Protocol):
    """The one exchange protocol a route's transport speaks (`GlooChannel`, `ShmRoute`).

    `exchange(outgoing, incoming, tag=, what=, timeout=)` sends every framed outgoing
    message and returns one message from each incoming peer with the bytes sent; the
    contract is the module function `exchange` (its docstring). `begin_call()` is called
    once per `redistribute` call, before its exchanges.
    """

    name: ClassVar[str]
    """The transport's name (`gloo`, `shm`), as `runtime.coordinator_transport` says it."""
    shared: ClassVar[bool]
    """Whether a message addressed to many peers costs one write (shared memory)."""

    def begin_call(self) -> ExchangeChannel:
        """Starts one `redistribute` call; returns the channel to use for it."""
        ...

    def exchange(self, outgoing: Iterable[tuple[int, torch.Tensor, int]],
                 incoming: Mapping[int, int], *, tag: int, what: str,
                 timeout: float) -> tuple[dict[int, torch.Tensor], int]:
        """Sends `outgoing`, receives one message per `incoming` peer (`exchange`)."""
        ...


def frame(payload: torch.Tensor) -> torch.Tensor:
    """Returns `payload`'s bytes behind an 8-byte length prefix (one `uint8` tensor)."""
    body = payload.detach().contiguous().reshape(-1).view(torch.uint8)
    out = torch.empty(8 + body.numel(), dtype=torch.uint8)
    out[:8] = torch.tensor([out.numel()], dtype=torch.int64).view(torch.uint8)
    out[8:] = body
    return out


def message_length(message: torch.Tensor) -> int:
    """The length in bytes a message's prefix declares."""
    return int.from_bytes(message[:8].numpy().tobytes(), sys.byteorder)


def exchange(
    outgoing: Iterable[tuple[int, torch.Tensor, int]],
    incoming: Mapping[int, int],
    *,
    tag: int,
    what: str,
    timeout: float,
) -> tuple[dict[int, torch.Tensor], int]:
    """Sends every outgoing message and receives one message from each incoming peer.

    Receives are posted first. `outgoing` may be a generator that packs lazily: each
    message is posted as soon as it is produced, while the next one is packed.

    Args:
        outgoing: `(peer, message, capacity)`: a framed message and the capacity `peer`
            posted for it.
        incoming: Peer → capacity in bytes of the message expected from it.
        tag: Tag of the heads; tails use `tag + 1`.
        what: Names the exchange in timeout errors.
        timeout: Seconds per wait.

    Returns:
        Peer → the received message (a view of its exact length), and the bytes sent.

    Raises:
        WorkerFailedError: a peer did not answer within `timeout`.
        ValueError: a received message is malformed (shorter than its prefix).
    """
    heads = {peer: torch.empty(max(MIN_CAPACITY, cap), dtype=torch.uint8)
             for peer, cap in incoming.items()}
    head_works = [dist.irecv(buf, src=peer, tag=tag) for peer, buf in heads.items()]
    send_works, keep_alive, sent = [], [], 0
    for peer, message, capacity in outgoing:
        capacity = max(MIN_CAPACITY, capacity)
        keep_alive.append(message)
        send_works.append(dist.isend(message[:capacity], dst=peer, tag=tag))
        if message.numel() > capacity:
            send_works.append(dist.isend(message[capacity:], dst=peer, tag=tag + 1))
        sent += message.numel()
    wait_all(head_works, f"{what}: receiving", timeout)
    received, tail_works = {}, []
    for peer, head in heads.items():
        length = message_length(head)
        if length < 8:
            raise ValueError(f"{what}: rank {peer} sent a message declaring {length} bytes; "
                             "every message starts with its own length (coordinator.exchange).")
        if length <= head.numel():
            received[peer] = head[:length]
            continue
        full = torch.empty(length, dtype=torch.uint8)
        full[: head.numel()] = head
        tail_works.append(dist.irecv(full[head.numel():], src=peer, tag=tag + 1))
        received[peer] = full
    wait_all(tail_works + send_works, f"{what}: moving data", timeout)
    return received, sent


@attrs.frozen
class GlooChannel:
    """The gloo transport of a route's exchanges (`exchange`, one message per pair)."""

    name = "gloo"
    #: Whether a message addressed to many peers costs one write (no: one send each).
    shared = False

    def begin_call(self) -> GlooChannel:
        """Nothing to count: gloo tags do not depend on the call."""
        return self

    exchange = staticmethod(exchange)
