"""Every socket that `pdserve serve` and its workers listen on (HTTP, control, KV receivers,
metrics) is bound to loopback by default: read from /proc, not from the code's intentions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from servers import children

pytestmark = pytest.mark.slow
LISTEN = "0A"


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening(inodes: set[str]) -> list[tuple[str, int]]:
    """(local address in /proc hex form, port) of every listening TCP socket among `inodes`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == LISTEN and f[9] in inodes:
                addr, port = f[1].split(":")
                out.append((addr, int(port, 16)))
    return out


def is_loopback_hex(addr: str) -> bool:
    if len(addr) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return addr.endswith("7F")
    return addr == "00000000000000000000000001000000"  # ::1


def test_every_listening_socket_is_loopback(secured):
    pids = [secured.server.proc.pid, *children(secured.server.proc.pid)]
    inodes = set().union(*(socket_inodes(p) for p in pids))
    socks = listening(inodes)
    assert len(socks) >= 3  # HTTP, control, the decode worker's KV receiver
    assert [a for a, _ in socks if not is_loopback_hex(a)] == []
    assert int(secured.url.rsplit(":", 1)[1]) in {port for _, port in socks}
