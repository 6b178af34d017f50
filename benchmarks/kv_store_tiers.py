"""Measure the store: `python benchmarks/kv_store_tiers.py` (put, load from DRAM, load from SSD).

Starts a store process per (transport, tier) on this machine, puts `--blocks` blocks of a
SmolLM2-135M bfloat16 layout (block size 16: 360 KiB per block) from one cache, loads them into
another, checks they are bit-identical, and prints MB/s and milliseconds. `--repeats` runs put
and load that many times (fresh blocks each time) and reports the median and the best.
`--transports tcp nixl` compares the two data paths (nixl needs nixl-cu12). `--mooncake` adds a
row for a Mooncake Store pool (a loopback mooncake_master; writer and reader each contribute a
segment): the same put and load through `MooncakeStoreClient` (needs pdserve[mooncake]).
"""

from __future__ import annotations

import argparse
import contextlib
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from pdserve.engine.block_hash import block_hashes
from pdserve.kv_store.client import StoreClient
from pdserve.kv_store.config import payload_bytes
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.registry import TRANSPORTS

SMOLLM2 = KVLayout("smollm2-135m", "bfloat16", 30, 16, 3, 64)


def _start(store_dir: str, dram_gb: float, transport: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pdserve.kv_store.cli", "store", "--store-dir", store_dir,
           "--dram-gb", str(dram_gb), "--ssd-gb", "8", "--transport", transport]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    endpoint = re.search(r"listening on (\S+)", proc.stdout.readline()).group(1)  # type: ignore
    return proc, endpoint


def _caches(n: int, fill: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (n, SMOLLM2.block_size, SMOLLM2.num_kv_heads, SMOLLM2.head_dim)
    make = (lambda: torch.randn(shape).to(torch.bfloat16)) if fill else (
        lambda: torch.zeros(shape, dtype=torch.bfloat16))  # fmt: skip
    return [make() for _ in range(30)], [make() for _ in range(30)]


@contextlib.contextmanager
def _store(tier: str, transport: str, n: int):
    """(endpoint, client class) of a fresh store: `pdserve store`, or for transport "mooncake"
    a loopback mooncake_master whose pool the clients' segments make up."""
    with tempfile.TemporaryDirectory() as d:
        if transport == "mooncake":
            from pdserve.kv_store.mooncake import MooncakeStoreClient
            from pdserve.kv_store.mooncake_setup import master_command

            ports = []
            for _ in range(2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    ports.append(s.getsockname()[1])
            log = open(f"{d}/master.log", "w+")  # noqa: SIM115 (closed with the directory)
            proc = subprocess.Popen(master_command("127.0.0.1", *ports), stdout=log, stderr=log)
            while "Master service started" not in open(log.name).read():
                time.sleep(0.05)
            mb = 2 * n * payload_bytes(SMOLLM2) // (1 << 20) + 64  # every repeat's blocks
            endpoint = f"mooncake://127.0.0.1:{ports[0]}?segment_mb={mb}&buffer_mb=256"
            client = MooncakeStoreClient
        else:
            proc, endpoint = _start(d, 8 if tier == "dram" else 0, transport)
            client = StoreClient
        try:
            yield endpoint, client
        finally:
            proc.terminate()
            proc.wait(10)


def measure(n: int, tier: str, transport: str = "tcp", repeats: int = 1) -> dict[str, list]:
    """Seconds to put `n` blocks and to load them back from `tier` ("dram" or "ssd"), once per
    repeat (each repeat with blocks the store has not seen)."""
    src, dst = _caches(n, True), _caches(n, False)
    out: dict[str, list] = {"put_s": [], "load_s": []}
    with _store(tier, transport, n * repeats) as (endpoint, client):
        writer = client(endpoint, SMOLLM2, *src, timeout_s=60)
        reader = client(endpoint, SMOLLM2, *dst, timeout_s=60)
        bs = SMOLLM2.block_size
        for r in range(repeats):  # fresh tokens per repeat: the store must not hold them
            tokens = list(range(r * n * bs, (r + 1) * n * bs))
            hashes = block_hashes(tokens, bs)
            per_block = [tokens[i * bs : (i + 1) * bs] for i in range(n)]
            t0 = time.perf_counter()
            ticket = writer.put(hashes, per_block, list(range(n)))
            assert ticket.wait(120) and ticket.ok, ticket.error
            out["put_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = reader.load(hashes, list(range(n)), timeout_s=120)
            out["load_s"].append(time.perf_counter() - t0)
            pairs = zip([*src[0], *src[1]], [*dst[0], *dst[1]], strict=True)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)
            assert got == n and same, f"loaded {got} of {n}, bit-identical: {same}"
            for t in (*dst[0], *dst[1]):
                t.zero_()
        writer.close()
        reader.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256, help="blocks per run (default 256)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per case (default 1)")
    parser.add_argument("--transports", nargs="+", default=["tcp"], choices=TRANSPORTS)
    parser.add_argument("--mooncake", action="store_true", help="add a Mooncake Store pool row")
    args = parser.parse_args(argv)
    mb = args.blocks * payload_bytes(SMOLLM2) / 1e6
    print(f"{args.blocks} blocks x {payload_bytes(SMOLLM2)} B = {mb:.1f} MB (SmolLM2-135M bf16)")
    print("transport tier  put ms (best)     load ms (best)    put MB/s  load MB/s")
    cases = [(t, tier) for t in args.transports for tier in ("dram", "ssd")]
    for transport, tier in cases + ([("mooncake", "dram")] if args.mooncake else []):
        r = measure(args.blocks, tier, transport, args.repeats)
        put, load = statistics.median(r["put_s"]), statistics.median(r["load_s"])
        print(f"{transport:9} {tier:4}  {1e3 * put:7.1f} ({1e3 * min(r['put_s']):6.1f})  "
              f"{1e3 * load:7.1f} ({1e3 * min(r['load_s']):6.1f})  {mb / put:8.0f}  "
              f"{mb / load:9.0f}", flush=True)  # fmt: skip
    print("every load bit-identical to what was put; medians of", args.repeats, "runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
