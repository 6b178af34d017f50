"""A wire that delays and drops frames: the netem qdisc's delay and loss, in user space, for
kernels built without netem (bench/netns.py puts one between a host's switch port and the bridge
when `Host.shape(delay_ms=.., loss_pct=..)` asks for them).

    python -m pdserve.bench.wire A B --delay-ms 50 --loss-pct 5 [--seed 1]

Relays every Ethernet frame between interfaces A and B (raw AF_PACKET sockets, in the namespace
it runs in), each way: a frame is dropped with probability loss-pct/100, else sent on delay-ms
after it arrived (in order: a constant delay keeps a FIFO). Frames keep their virtio-net header
(PACKET_VNET_HDR), so checksum offload and GSO pass through untouched; a GSO frame counts as one
frame for loss, as one segment burst would on a NIC that drops in bursts. Prints "wire ready"
once both sockets are bound; exits on SIGTERM/SIGKILL (the namespace's teardown kills it).
"""

from __future__ import annotations

import argparse
import collections
import random
import select
import socket
import sys
import threading
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # the kernel's copy of a frame this socket's interface sent: not ours to relay
PACKET_VNET_HDR = 15
SOL_PACKET = 263
FRAME = 65536 + 64  # the largest GSO frame plus its virtio-net header


def open_port(ifname: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    sock.bind((ifname, ETH_P_ALL))
    sock.setblocking(False)
    return sock


def relay(src: socket.socket, dst: socket.socket, delay_s: float, loss: float,
          rng: random.Random) -> None:  # fmt: skip
    """Forever: frames read from `src` go out of `dst` `delay_s` later, unless dropped."""
    due: collections.deque[tuple[float, bytes]] = collections.deque()
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else None
        if select.select([src], [], [], wait)[0]:
            now = time.monotonic()
            while True:
                try:
                    frame, where = src.recvfrom(FRAME)
                except BlockingIOError:
                    break
                if where[2] != PACKET_OUTGOING and rng.random() >= loss:
                    due.append((now + delay_s, frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            try:
                dst.send(due.popleft()[1])
            except (BlockingIOError, OSError):  # a full queue or a port that is down: lost
                pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.bench.wire",
        description="Relay frames between two interfaces with a delay and a loss rate (a "
        "user-space netem; run it inside the namespace that holds both).",
    )  # fmt: skip
    parser.add_argument("a", help="one interface")
    parser.add_argument("b", help="the other interface")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each way")
    parser.add_argument("--loss-pct", type=float, default=0.0, help="frames dropped, each way")
    parser.add_argument("--seed", type=int, default=None, help="the loss draws' seed")
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or not 0 <= args.loss_pct < 100:
        parser.error("--delay-ms must be >= 0 and --loss-pct in [0, 100)")
    a, b = open_port(args.a), open_port(args.b)
    delay_s, loss = args.delay_ms / 1e3, args.loss_pct / 100
    for src, dst, k in ((a, b, 0), (b, a, 1)):
        rng = random.Random(None if args.seed is None else args.seed + k)
        threading.Thread(target=relay, args=(src, dst, delay_s, loss, rng), daemon=True).start()
    print("wire ready", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    sys.exit(main())
