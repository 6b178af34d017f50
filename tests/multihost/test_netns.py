"""The harness itself (bench/netns.py): hosts reach each other and nothing else, the machine's
own namespace gets no interface, shaping limits a link's rate, delays and drops its frames, and
every namespace goes at close,
also a crashed run's (its pid gone) at the next start."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time

import pytest
from waiting import wait_until

from pdserve.bench import netns


def _links() -> set[str]:
    """The interface names of the machine's own namespace."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def _throughput_bit(a: netns.Host, b: netns.Host, nbytes: int) -> float:
    server = b.call(socket.create_server, (b.address, 0))
    port = server.getsockname()[1]
    conn_box = {}
    accepting = threading.Thread(target=lambda: conn_box.setdefault("c", server.accept()[0]))
    accepting.start()
    client = a.call(socket.create_connection, (b.address, port), 10)
    accepting.join(10)
    conn = conn_box["c"]
    start = time.perf_counter()
    sender = threading.Thread(target=client.sendall, args=(b"x" * nbytes,))
    sender.start()
    got = 0
    while got < nbytes:
        got += len(conn.recv(1 << 20))
    sender.join()
    took = time.perf_counter() - start
    for s in (client, conn, server):
        s.close()
    return nbytes * 8 / took


def test_hosts_reach_each_other_only_and_leave_nothing_behind():
    before = _links()
    with netns.Network() as net:
        a, b = net.add_host("a"), net.add_host("b")
        assert _links() == before  # every interface is in a namespace of the harness
        assert _throughput_bit(a, b, 2_000_000) > 0
        with pytest.raises(OSError):  # no route out of a host
            a.call(socket.create_connection, ("192.0.2.1", 9), 2)
        a.shape(rate_bit=20e6)
        rate = _throughput_bit(a, b, 2_500_000)  # 1 s at 20 Mbit/s
        assert 10e6 < rate < 24e6, rate
        a.unshape()
        listening = b.call(socket.create_server, (b.address, 0))
        port = listening.getsockname()[1]
        a.partition()
        with pytest.raises(TimeoutError):  # no answer, not even a refusal
            a.call(socket.create_connection, (b.address, port), 1)
        a.heal()
        a.call(socket.create_connection, (b.address, port), 10).close()
        listening.close()
        names = list(net.made)
    assert not set(names) & set(netns._namespaces())
    assert _links() == before


def _connect_ms(a: netns.Host, b: netns.Host, port: int) -> float:
    """One TCP handshake from a to b: a round trip, in ms."""
    start = time.perf_counter()
    a.call(socket.create_connection, (b.address, port), 10).close()
    return (time.perf_counter() - start) * 1e3


def test_delay_and_loss_shape_a_link_and_unshaping_restores_it():
    before = _links()
    with netns.Network() as net:
        a, b = net.add_host("a"), net.add_host("b")
        listening = b.call(socket.create_server, (b.address, 0), backlog=64)
        port = listening.getsockname()[1]
        b.shape(delay_ms=40)
        rtts = sorted(_connect_ms(a, b, port) for _ in range(5))
        assert rtts[0] >= 80, rtts  # 40 ms each way, on every frame
        b.shape(loss_pct=20, seed=3)  # replaces the delay
        assert sorted(_connect_ms(a, b, port) for _ in range(3))[0] < 80
        receiver = b.call(socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
        receiver.bind((b.address, 0))
        receiver.settimeout(2)
        sender = a.call(socket.socket, socket.AF_INET, socket.SOCK_DGRAM)
        n, got = 1000, []

        def receive() -> None:  # until 2 s pass with nothing
            try:
                while True:
                    got.append(receiver.recv(64))
            except TimeoutError:
                pass

        counting = threading.Thread(target=receive)
        counting.start()
        for i in range(n):
            sender.sendto(b"%d" % i, receiver.getsockname())
            if i % 20 == 19:
                time.sleep(0.005)  # no burst larger than the sockets' buffers
        counting.join(30)
        got = len(got)
        assert 0.7 * n < got < 0.9 * n, got  # 20 % of frames dropped (binomial: +-8 sd)
        assert _links() == before  # the wire's interfaces are in the switch's namespace
        b.unshape()
        assert sorted(_connect_ms(a, b, port) for _ in range(3))[0] < 40
        for s in (receiver, sender, listening):
            s.close()
    assert _links() == before


def test_a_crashed_runs_namespaces_are_removed_at_the_next_start():
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid nobody has now: the crashed run's
    stale = f"{netns.PREFIX}{dead.pid}-host"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "600"])
    with netns.Network():
        assert stale not in netns._namespaces()
    assert sleeper.wait(10) != 0  # what ran in it was killed


def test_terminate_stops_a_hosts_processes_in_its_rounds_and_nothing_else():
    with netns.Network() as net:
        a, b = net.add_host("a"), net.add_host("b")
        polite = a.popen(["sleep", "301"])
        stubborn = a.popen(["sh", "-c", "trap '' TERM; exec sleep 302"])  # ignores SIGTERM
        other = b.popen(["sleep", "303"])
        try:
            started = {polite: "sleep 301", stubborn: "sleep 302", other: "sleep 303"}
            wait_until(  # each in its host (`ip netns exec` enters it, then execs), the trap set
                lambda: all(netns._cmdline(p.pid).startswith(c) for p, c in started.items()),
                10,
                "the sleeps to start in their hosts",
            )
            assert sorted(a.pids()) == sorted([polite.pid, stubborn.pid])
            assert a.terminate(first=("301",), timeout_s=0.5) == [stubborn.pid]
            assert (polite.wait(5), stubborn.wait(5)) == (-signal.SIGTERM, -signal.SIGKILL)
            assert a.pids() == [] and other.poll() is None and b.pids() == [other.pid]
        finally:
            other.kill()
            other.wait()
