"""The TCP sockets a process listens on, read from /proc (what `ss -ltnp` shows)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

_LISTEN = "0A"


def _address(hex_address: str) -> tuple[str, int]:
    """`/proc/net/tcp{,6}`'s `ADDR:PORT` (host-order 32-bit words) as `(ip, port)`."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    words = struct.unpack(f"<{len(raw) // 4}I", raw)  # each word is in host byte order
    packed = b"".join(struct.pack(">I", w) for w in words)
    return str(ipaddress.ip_address(packed)), int(port, 16)


def _listening_inodes() -> dict[str, tuple[str, int]]:
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == _LISTEN:
                found[fields[9]] = _address(fields[1])
    return found


def listening(pid: int) -> list[tuple[str, int]]:
    """`(ip, port)` of every TCP socket `pid` listens on (this network namespace)."""
    tables = _listening_inodes()
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target[8:-1] in tables:
            out.append(tables[target[8:-1]])
    return sorted(set(out))


def is_loopback(ip: str) -> bool:
    """Whether `ip` is a loopback address (an IPv4-mapped one included)."""
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def outside_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or `None` when it has none."""
    candidates = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("198.51.100.1", 9))  # TEST-NET-2: picks a route, sends nothing
        candidates.append(probe.getsockname()[0])
    except OSError:
        pass
    finally:
        probe.close()
    try:
        candidates += [info[4][0] for info in socket.getaddrinfo(
            socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    return next((a for a in candidates if not ipaddress.ip_address(a).is_loopback), None)
