"""Raw KV transfer bandwidth of the connectors against this machine's limits.

For a SmolLM2-135M-shaped cache (30 layers, 3 KV heads, head_dim 64, block 16) it moves every
layer of a 512- and a 2048-token prompt from this process to a receiver in a second process, and
prints the median over repeats next to the memcpy bandwidth (torch copy_) and the raw loopback
socket bandwidth (sendall -> recv_into, no protocol) for the same bytes. The "tcp fp8" row sends
the same KV FP8-compressed (about half the wire bytes for bfloat16); its MB and GB/s count the
uncompressed KV bytes, i.e. the effective bandwidth.

    .venv/bin/python benchmarks/kv_transfer_raw.py [--dtype bfloat16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import socket
import statistics
import time

import torch

from pdserve.kv_transfer import KVLayout, make_receiver, make_sender

BLOCK = 16


def smollm_layout(dtype: str) -> KVLayout:
    return KVLayout("SmolLM2-135M", dtype, num_layers=30, block_size=BLOCK, num_kv_heads=3,
                    head_dim=64)  # fmt: skip


def caches(layout: KVLayout, num_blocks: int, random: bool) -> tuple[list, list]:
    shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    dtype = getattr(torch, layout.dtype)
    make = (
        (lambda: torch.randn(shape).to(dtype))
        if random
        else (lambda: torch.zeros(shape, dtype=dtype))
    )
    return [make() for _ in range(layout.num_layers)], [make() for _ in range(layout.num_layers)]


def memcpy_seconds(nbytes: int, repeats: int) -> list[float]:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def _raw_sink(port_q, nbytes: int, repeats: int) -> None:
    """Child: accept one connection, read `nbytes` per repeat into one buffer, ack each."""
    server = socket.create_server(("127.0.0.1", 0))
    port_q.put(server.getsockname()[1])
    conn, _ = server.accept()
    buf = memoryview(bytearray(nbytes))
    for _ in range(repeats + 1):
        got = 0
        while got < nbytes:
            got += conn.recv_into(buf[got:])
        conn.sendall(b"k")
    conn.close()


def socket_seconds(nbytes: int, repeats: int) -> list[float]:
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    child = ctx.Process(target=_raw_sink, args=(port_q, nbytes, repeats))
    child.start()
    sock = socket.create_connection(("127.0.0.1", port_q.get(timeout=60)))
    payload = memoryview(bytearray(nbytes))
    times = []
    for i in range(repeats + 1):  # the first round warms the connection up
        t0 = time.perf_counter()
        sock.sendall(payload)
        sock.recv(1)
        if i:
            times.append(time.perf_counter() - t0)
    sock.close()
    child.join()
    return times


def _receiver_proc(backend: str, layout: KVLayout, num_blocks: int, cmds, replies) -> None:
    k, v = caches(layout, num_blocks, random=False)
    receiver = make_receiver(backend, layout, k, v)
    receiver.start()
    replies.put(receiver.endpoint)
    while (cmd := cmds.get())[0] != "stop":
        if cmd[0] == "expect":
            receiver.expect(cmd[1], cmd[2])
        else:
            receiver.release(cmd[1])
        replies.put("ok")
    receiver.close()


def connector_seconds(
    backend: str, layout: KVLayout, num_blocks: int, repeats: int, **sender_options
) -> list[float]:
    """Times from the first send_layer to wait() returning (every layer acknowledged)."""
    ctx = mp.get_context("spawn")
    cmds, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver_proc, args=(backend, layout, num_blocks, cmds, replies))
    child.start()
    endpoint = replies.get(timeout=120)
    sender = make_sender(
        backend, layout, *caches(layout, num_blocks, random=True), **sender_options
    )
    ids = list(range(num_blocks))
    times = []
    for i in range(repeats + 1):  # round 0 opens the connection
        cmds.put(("expect", f"t{i}", ids))
        replies.get(timeout=60)
        t0 = time.perf_counter()
        for layer in range(layout.num_layers):
            sender.send_layer(endpoint, f"t{i}", layer, ids, ids)
        result = sender.wait(f"t{i}", timeout_s=120)
        elapsed = time.perf_counter() - t0
        if not result.ok:
            raise RuntimeError(f"{backend} transfer failed: {result.error}")
        if i:
            times.append(elapsed)
        cmds.put(("release", f"t{i}"))
        replies.get(timeout=60)
    sender.close()
    cmds.put(("stop",))
    child.join()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per cell (median)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    args = parser.parse_args()
    layout = smollm_layout(args.dtype)
    backends = ["tcp"] + (["nixl"] if importlib.util.find_spec("nixl_cu12") or
                          importlib.util.find_spec("nixl") else [])  # fmt: skip
    print(f"SmolLM2-135M KV cache, {args.dtype}, {layout.num_layers} layers, block {BLOCK}; "
          f"median (and best) of {args.repeats}; GB/s = 1e9 bytes/s of the median")  # fmt: skip
    print(f"{'path':<15}{'tokens':>6}{'MB':>6}{'ms':>8}{'best':>7}{'GB/s':>7}"
          f"{'% memcpy':>10}{'% socket':>10}")  # fmt: skip
    for tokens in args.tokens:
        blocks = -(-tokens // BLOCK)
        nbytes = 2 * layout.num_layers * blocks * layout.block_bytes
        rows = {"memcpy": memcpy_seconds(nbytes, args.repeats),
                "raw socket": socket_seconds(nbytes, args.repeats)}  # fmt: skip
        for backend in backends:
            rows[f"{backend} connector"] = connector_seconds(backend, layout, blocks, args.repeats)
        rows["tcp fp8"] = connector_seconds("tcp", layout, blocks, args.repeats, compression="fp8")
        med = {name: statistics.median(times) for name, times in rows.items()}
        for name, times in rows.items():
            m = med[name]
            print(f"{name:<15}{tokens:>6}{nbytes / 1e6:>6.1f}{m * 1e3:>8.2f}"
                  f"{min(times) * 1e3:>7.2f}{nbytes / m / 1e9:>7.2f}"
                  f"{med['memcpy'] / m:>10.0%}{med['raw socket'] / m:>10.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
