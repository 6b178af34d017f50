"""Hosts on one machine: Linux network namespaces joined by a bridge, for running pdserve's
processes each on a host of its own, with links shaped and cut (tests/multihost,
benchmarks/network_matrix.py; the recipe: docs/serving.md#multi-host).

    with Network() as net:
        router, decode = net.add_host("router"), net.add_host("decode")
        decode.shape(rate_bit=1e9)          # its link, both ways, 1 Gbit/s (tc tbf)
        decode.shape(delay_ms=50, loss_pct=5)  # ...or 50 ms late and 5 % lost (bench/wire.py)
        proc = decode.popen([sys.executable, "-m", "pdserve.cli", "worker", ...])
        decode.partition(); decode.heal()   # its switch port down, then up
        router.call(httpx.get, f"http://{router.address}:8000/health")  # a socket in its ns

Layout: one "switch" namespace holds a bridge; each host is a namespace with `lo` and `eth0`, the
end of a veth pair whose other end is a port of that bridge, and an address on one /24. Every
interface is created inside a namespace made here (never in the machine's own namespace), and
no namespace has a route out, so all traffic stays between the hosts. Names start with
`pdn<pid>-`: `close()` (the context manager's exit, and atexit) kills what still runs in them
and deletes them, which removes their links; a run that was killed leaves them behind, and the
next `Network()` removes every `pdn<pid>-` namespace whose pid is gone (`remove_stale`).

Needs root and iproute2 (`ip`, `tc`): `unavailable()` says why not. Rates use tbf; delay and
loss use a user-space wire (bench/wire.py: raw sockets relaying the host's frames to the bridge,
late or not at all), since some kernels have no netem qdisc and its results would differ.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PREFIX = "pdn"
SUBNET = "10.77.0"  # hosts get .1, .2, ...: private, and reachable only from these namespaces
# Jumbo frames, as on datacenter links: a shaped link (tbf) cuts TCP's 64 KB segments into
# frames, whose per-frame cost on these shared cores is the emulation's, not the NIC's (at 1,500
# bytes, a 100 Mbit/s push slowed the prefill beside it by up to 2x on 2 cores)
MTU = 9000
_STALE = re.compile(rf"^{PREFIX}(\d+)-")
_CLONE_NEWNET = 0x40000000


class ShapingUnavailable(RuntimeError):
    """The link cannot be shaped that way here (the user-space wire did not start)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why hosts cannot be made here (not root, no `ip`/`tc`, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # it exited
        return ""


def _kill_inside(ns: str) -> None:
    """SIGKILL every process still running in namespace `ns`."""
    for pid in _ip("netns", "pids", ns, check=False).stdout.split():
        _signal(int(pid), signal.SIGKILL)


def remove_stale() -> list[str]:
    """Delete the namespaces (and so their links) of runs whose process is gone, killing what
    still runs in them; return their names."""
    stale = [ns for ns in _namespaces() if (m := _STALE.match(ns)) and not _alive(int(m[1]))]
    for ns in stale:
        _kill_inside(ns)
        _ip("netns", "del", ns, check=False)
    return stale


class Host:
    """One namespace on the bridge: `address` on `eth0`, its own loopback, no route out."""

    def __init__(self, net: Network, name: str, index: int):
        self.net, self.name = net, name
        self.ns = f"{net.prefix}{name}"
        self.address = f"{SUBNET}.{index}"
        self.port = f"p{index}"  # its end on the switch
        self.index = index
        self.wire: subprocess.Popen | None = None  # bench/wire.py, while delay/loss are shaped
        _ip("netns", "add", self.ns)
        net.made.append(self.ns)
        _ip("-n", net.switch, "link", "add", self.port, "mtu", str(MTU), "type", "veth",
            "peer", "name", "eth0", "mtu", str(MTU), "netns", self.ns)  # fmt: skip
        _ip("-n", net.switch, "link", "set", self.port, "master", "br0", "up")
        _ip("-n", self.ns, "addr", "add", f"{self.address}/24", "dev", "eth0")
        _ip("-n", self.ns, "link", "set", "eth0", "up")
        _ip("-n", self.ns, "link", "set", "lo", "up")

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address})"

    # -- processes -------------------------------------------------------------------------
    def prefix(self) -> list[str]:
        """argv that runs the rest inside this host: `ip netns exec NS` (it execs, so the pid
        is the command's own)."""
        return ["ip", "netns", "exec", self.ns]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen([*self.prefix(), *argv], **kwargs)

    def run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return _run([*self.prefix(), *argv], check)

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on a thread of this process that has entered this host's
        network namespace: the sockets it makes are this host's (a client on it). Returns its
        result or raises what it raised."""
        box: dict = {}

        def inside() -> None:
            try:
                with open(f"/run/netns/{self.ns}") as handle:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns into {self.ns} failed")
                box["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc

        thread = threading.Thread(target=inside, name=f"netns-{self.name}", daemon=True)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def pids(self) -> list[int]:
        """The processes running in this host (`ip netns pids`: those whose network namespace
        is this host's)."""
        return [int(pid) for pid in _ip("netns", "pids", self.ns, check=False).stdout.split()]

    def terminate(
        self, first: tuple[str, ...] = (), last: tuple[str, ...] = (), timeout_s: float = 20.0
    ) -> list[int]:
        """SIGTERM every process in this host, in three rounds: those whose command line names
        one of `first`, then all but those naming one of `last`, then the rest (the order `ray
        stop` keeps: raylet, its agents, GCS; a GCS told with the others outlived 20 s). Each
        round SIGKILLs what is left of it after `timeout_s`; returns the pids that needed it.
        Unlike a tool that finds its processes by name (`ray stop`), it touches nothing outside
        this host."""
        killed: list[int] = []
        rounds = (
            lambda cmd: any(x in cmd for x in first),
            lambda cmd: not any(x in cmd for x in last),
            lambda cmd: True,
        )
        for chosen in rounds:
            pids = [pid for pid in self.pids() if chosen(_cmdline(pid))]
            for pid in pids:
                _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while (left := set(pids) & set(self.pids())) and time.monotonic() < deadline:
                time.sleep(0.1)
            for pid in left:
                _signal(pid, signal.SIGKILL)
            killed += left
        return killed

    # -- the link --------------------------------------------------------------------------
    def shape(
        self,
        rate_bit: float | None = None,
        *,
        delay_ms: float | None = None,
        loss_pct: float | None = None,
        seed: int | None = None,
    ) -> None:
        """Shape this host's link, both ways: at most `rate_bit` bits/s (tbf on `eth0` and on
        its switch port), each frame `delay_ms` late and `loss_pct` % of frames dropped (a
        user-space wire, bench/wire.py, between the switch port and the bridge: it works the
        same on kernels built without the netem qdisc). Replaces any earlier shaping."""
        self.unshape()
        if rate_bit is not None:
            rate = int(rate_bit)
            # The bucket: >= one MTU, and ~1 ms of the rate so that fast links are not held
            # back by timer resolution (tbf segments GSO packets larger than it).
            burst = max(16 * 1024, rate // 8 // 1000)
            for ns, dev in self._ends():
                _ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                    "rate", f"{rate}bit", "burst", str(burst), "latency", "100ms")  # fmt: skip
        if delay_ms or loss_pct:
            self._wire_in(delay_ms or 0.0, loss_pct or 0.0, seed)

    def _ends(self) -> tuple[tuple[str, str], ...]:
        return (self.ns, "eth0"), (self.net.switch, self.port)

    def _wire_in(self, delay_ms: float, loss_pct: float, seed: int | None) -> None:
        """Move the switch port off the bridge and relay its frames to a new bridge port
        (`b<i>`, a veth pair with `w<i>`) through bench/wire.py."""
        sw, wire, bridged = self.net.switch, f"w{self.index}", f"b{self.index}"
        _ip("-n", sw, "link", "set", self.port, "nomaster")
        _ip("-n", sw, "link", "add", wire, "mtu", str(MTU), "type", "veth",
            "peer", "name", bridged, "mtu", str(MTU))  # fmt: skip
        _ip("-n", sw, "link", "set", bridged, "master", "br0", "up")
        for dev in (self.port, wire):
            _ip("-n", sw, "link", "set", dev, "promisc", "on", "up")
        argv = [sys.executable, "-m", "pdserve.bench.wire", self.port, wire,
                "--delay-ms", str(delay_ms), "--loss-pct", str(loss_pct)]  # fmt: skip
        if seed is not None:
            argv += ["--seed", str(seed)]
        proc = subprocess.Popen(["ip", "netns", "exec", sw, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        ready = proc.stdout.readline()
        if "wire ready" not in ready:
            proc.kill()
            err = proc.communicate()[1].strip()
            self._wire_out()
            raise ShapingUnavailable(f"the user-space wire did not start: {err or ready!r}")
        self.wire = proc

    def _wire_out(self) -> None:
        sw = self.net.switch
        if self.wire is not None:
            self.wire.kill()
            self.wire.wait()
            self.wire = None
        _ip("-n", sw, "link", "del", f"w{self.index}", check=False)  # its peer goes with it
        _ip("-n", sw, "link", "set", self.port, "master", "br0", check=False)

    def unshape(self) -> None:
        for ns, dev in self._ends():
            _ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if self.wire is not None:
            self._wire_out()

    def partition(self) -> None:
        """Cut this host off: its switch port down (its `eth0` loses carrier; packets either
        way are dropped, no connection is told)."""
        _ip("-n", self.net.switch, "link", "set", self.port, "down")

    def heal(self) -> None:
        _ip("-n", self.net.switch, "link", "set", self.port, "up")

    def bytes_sent(self) -> int:
        """Bytes `eth0` has sent (its kernel counter)."""
        return self._counter("TX:")

    def bytes_received(self) -> int:
        """Bytes `eth0` has received (its kernel counter)."""
        return self._counter("RX:")

    def _counter(self, heading: str) -> int:
        out = _ip("-n", self.ns, "-s", "link", "show", "eth0").stdout.splitlines()
        row = next(i for i, line in enumerate(out) if line.strip().startswith(heading))
        return int(out[row + 1].split()[0])


class Network:
    """A switch namespace with a bridge, and the hosts on it. A context manager: `close()` on
    exit (also at interpreter exit, if still open)."""

    _made = itertools.count()

    def __init__(self):
        if why := unavailable():
            raise RuntimeError(f"cannot make network hosts: {why}")
        remove_stale()
        # the pid for remove_stale, then a number: a process may hold several networks at once
        self.prefix = f"{PREFIX}{os.getpid()}-{next(Network._made)}-"
        self.switch = f"{self.prefix}switch"
        self.made: list[str] = []
        self.hosts: dict[str, Host] = {}
        self._closed = False
        atexit.register(self.close)
        _ip("netns", "add", self.switch)
        self.made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def add_host(self, name: str) -> Host:
        if name in self.hosts or name == "switch":
            raise ValueError(f"host name {name!r} is taken")
        host = Host(self, name, len(self.hosts) + 1)
        self.hosts[name] = host
        return host

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill whatever still runs in these hosts and delete every namespace made (their
        links go with them). Safe to call again."""
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self.made):
            _kill_inside(ns)
            _ip("netns", "del", ns, check=False)
        atexit.unregister(self.close)
