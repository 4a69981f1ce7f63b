"""Who a sandboxed program is on the host: its uid map inside, its uid seen from outside.

Inside bubblewrap the program reads `/proc/self/uid_map` as `65534 0 1`: with
`--disable-userns` it sits in a nested user namespace whose 65534 is uid 0 of bwrap's
outer one, which is what bwrap's own host uid maps to. So the map alone does not say who
the program is; the host does. `sandbox_identity` runs a program that names itself (its
`comm`, via `prctl`), finds it in the host's `/proc` while it runs, and reads its real,
effective and saved uids and its capabilities from there. `peerflow sandbox check` prints
both.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time

import attrs

from peerflow.sandbox.base import Sandbox, SandboxLimits, SandboxUnavailableError

PROGRAM = '''
import json, os, sys, time
try:
    import ctypes
    ctypes.CDLL(None).prctl(15, {marker!r}.encode(), 0, 0, 0)
except Exception:
    pass
print(json.dumps({{"map": " ".join(open("/proc/self/uid_map").read().split()),
                  "uid": os.getuid()}}))
sys.stdout.flush()
time.sleep({hold})
'''


@attrs.frozen(kw_only=True)
class Identity:
    """The program's identity inside and on the host."""

    inside_map: str
    """`/proc/self/uid_map` as the program reads it."""
    inside_uid: int | None
    host_uids: tuple[int, ...] | None
    """Real, effective, saved and filesystem uids from the host's `/proc` (`None`: unseen)."""
    host_caps: str | None
    """`CapEff` seen from the host."""

    @property
    def host_root(self) -> bool:
        """Whether any of the program's host uids is 0."""
        return self.host_uids is not None and 0 in self.host_uids

    def meaning(self) -> str:
        """One sentence: what the map means on this host."""
        if self.host_uids is None:
            return (f"the program reads uid_map {self.inside_map!r} (uid {self.inside_uid}); "
                    "its host uid could not be seen from here (a remote sandbox, or it did "
                    "not start)")
        host = self.host_uids[1]
        if self.host_root:
            return (f"{self.inside_uid} inside is the HOST'S ROOT (uid 0, CapEff "
                    f"{self.host_caps}): every root-owned file it can reach is its own")
        fields = self.inside_map.split()
        nested = len(fields) == 3 and fields[1] != str(host)
        how = (f" (a nested user namespace, bwrap's --disable-userns: its {fields[1]} is "
               "that uid of bwrap's own user namespace)" if nested else "")
        return (f"uid_map inside reads {self.inside_map!r}{how}: {self.inside_uid} inside is "
                f"host uid {host}, an unprivileged account (CapEff {self.host_caps}); "
                "nothing of the host's root is its own")


def _find(marker: str) -> str | None:
    """The host `/proc/PID` whose `comm` is `marker`, or `None`."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/comm") as comm:
                    if comm.read().strip() == marker:
                        return f"/proc/{entry.name}"
            except OSError:
                continue
    return None


def _host_view(proc: str) -> tuple[tuple[int, ...], str] | None:
    try:
        with open(f"{proc}/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
    except OSError:
        return None
    return tuple(int(u) for u in fields["Uid"].split()), fields["CapEff"].strip()


def sandbox_identity(sandbox: Sandbox, wait_s: float = 10.0) -> Identity:
    """Runs one program in `sandbox` and says who it is inside and on the host.

    Raises:
        SandboxUnavailableError: when the sandbox could not run it.
    """
    marker = f"pf-{secrets.token_hex(5)}"
    results: list = []

    def run() -> None:
        try:
            results.append(sandbox.run(PROGRAM.format(marker=marker, hold=1), "",
                                       SandboxLimits(timeout_s=wait_s + 5)))
        except SandboxUnavailableError as exc:
            results.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    seen, deadline = None, time.monotonic() + wait_s
    while seen is None and runner.is_alive() and time.monotonic() < deadline:
        proc = _find(marker)
        seen = _host_view(proc) if proc else None
        time.sleep(0.05)
    runner.join()
    if results and isinstance(results[0], SandboxUnavailableError):
        raise results[0]
    inside_map, inside_uid = "", None
    with contextlib.suppress(IndexError, ValueError, KeyError):
        said = json.loads(results[0].stdout)
        inside_map, inside_uid = said["map"], int(said["uid"])
    if seen is None and inside_map.split()[:3] == ["0", "0", "4294967295"]:
        # no user namespace (the audit-hook fallback): the uid inside is the host's
        seen = ((inside_uid,) * 4, "unknown")
    return Identity(inside_map=inside_map, inside_uid=inside_uid,
                    host_uids=seen[0] if seen else None, host_caps=seen[1] if seen else None)
