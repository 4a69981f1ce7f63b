"""Simulated hosts for multi-host tests: Linux network namespaces joined by a bridge.

`Hosts.create(n)` makes `n` namespaces ("hosts") with their own hostname (`h0`, `h1`, …,
through a UTS namespace per command, resolvable through a private /etc/hosts) and a
private address each (`10.<k>.0.<i+1>/24` on `eth0`), joined by veth pairs to a bridge
that lives in a switch namespace of its own, so traffic stays between them. Everything
is removed by `Hosts.destroy()` (deleting the namespaces deletes their links). Needs root,
iproute2 (`ip netns`) and util-linux (`unshare`); `unavailable()` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Sequence

import attrs

#: Machine-wide state a host's processes must not share with this machine's: Ray records
#: the cluster it started in /tmp/ray/ray_current_cluster, which a local `ray.init()`
#: would then join. Each host gets its own directory mounted there.
SHARED_STATE = "/tmp/ray"


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


def unavailable() -> str | None:
    """Why network namespaces cannot be used here, or `None` when they can."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (`ip`) or util-linux (`unshare`) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"pfprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"`ip netns add` fails here: {getattr(exc, 'stderr', exc)}".strip()
    return None


@attrs.define(eq=False)
class Hosts:
    """A set of namespaces acting as hosts on one private network."""

    tag: str
    count: int
    subnet: int
    procs: list[subprocess.Popen] = attrs.field(factory=list)
    hosts_file: str = ""
    """An /etc/hosts naming every host, bind-mounted in each command's mount namespace."""

    @classmethod
    def create(cls, count: int) -> Hosts:
        """Creates `count` hosts on a bridge; call `destroy()` when done."""
        tag = uuid.uuid4().hex[:5]
        hosts = cls(tag=tag, count=count, subnet=100 + int(tag, 16) % 100)
        try:
            hosts._build()
        except BaseException:
            hosts.destroy()
            raise
        return hosts

    @property
    def switch(self) -> str:
        return f"pf{self.tag}sw"

    def ns(self, i: int) -> str:
        """Namespace of host `i`."""
        return f"pf{self.tag}h{i}"

    def address(self, i: int) -> str:
        """Private address of host `i`."""
        return f"10.{self.subnet}.0.{i + 1}"

    def hostname(self, i: int) -> str:
        """Host name processes on host `i` see."""
        return f"h{i}"

    def _build(self) -> None:
        handle, self.hosts_file = tempfile.mkstemp(prefix=f"pf{self.tag}-hosts-")
        with os.fdopen(handle, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(
                f"{self.address(i)} {self.hostname(i)}\n" for i in range(self.count)))
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.count):
            ns, outer = self.ns(i), f"p{self.tag}{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", f"e{self.tag}{i}")
            _ip("link", "set", outer, "netns", self.switch)
            _ip("link", "set", f"e{self.tag}{i}", "netns", ns)
            _ip("-n", ns, "link", "set", f"e{self.tag}{i}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", outer, "master", "br0")
            _ip("-n", self.switch, "link", "set", outer, "up")

    def popen(self, i: int, argv: Sequence[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        """Starts `argv` on host `i` (its network namespace and host name)."""
        private = self.private_dir(i)
        os.makedirs(private, exist_ok=True)
        os.makedirs(SHARED_STATE, exist_ok=True)
        command = ["ip", "netns", "exec", self.ns(i), "unshare", "--uts", "--mount", "sh", "-c",
                   f'hostname {self.hostname(i)} && mount --bind {self.hosts_file} /etc/hosts'
                   f' && mount --bind {private} {SHARED_STATE} && exec "$@"', "sh", *argv]
        proc = subprocess.Popen(command, env=env, start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def private_dir(self, i: int) -> str:
        """Host `i`'s own copy of `SHARED_STATE` (a real host has its own /tmp)."""
        return f"{self.hosts_file}-h{i}"

    def pids(self, i: int) -> list[int]:
        """Every process running in host `i`'s namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.ns(i)], capture_output=True,
                             text=True).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, i: int) -> None:
        """SIGKILLs every process of host `i` (the host "dies")."""
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def cut_link(self, i: int) -> None:
        """Takes host `i`'s link down (its processes live on, unreachable)."""
        _ip("-n", self.ns(i), "link", "set", "eth0", "down")

    def limit_rate(self, i: int, rate: str) -> str | None:
        """Caps what host `i` sends at `rate` (`tc` token bucket on its `eth0`, e.g.
        `"1gbit"`); returns why it cannot (no `tc`, or the kernel lacks `sch_tbf`)."""
        if shutil.which("tc") is None:
            return "`tc` (iproute2) is not installed"
        done = subprocess.run(["tc", "-n", self.ns(i), "qdisc", "replace", "dev", "eth0",
                               "root", "tbf", "rate", rate, "burst", "256kb", "latency",
                               "500ms"], capture_output=True, text=True)
        return None if done.returncode == 0 else f"`tc qdisc … tbf` fails: {done.stderr.strip()}"

    def destroy(self) -> None:
        """Kills what the hosts still run and removes every namespace and link."""
        for i in range(self.count):
            self.kill_host(i)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in [self.ns(i) for i in range(self.count)] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.hosts_file:
            os.unlink(self.hosts_file)
            for i in range(self.count):
                shutil.rmtree(self.private_dir(i), ignore_errors=True)
