"""Measure the store: `python -m pdserve.kv_store.bench` (put, load from DRAM, load from SSD).

Starts a store process per tier on this machine, puts `--blocks` blocks of a SmolLM2-135M
bfloat16 layout (block size 16: 360 KiB per block) from one cache, loads them into another,
checks they are bit-identical, and prints MB/s and milliseconds per block.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time

import torch

from pdserve.engine.block_hash import block_hashes
from pdserve.kv_store.client import StoreClient
from pdserve.kv_store.config import payload_bytes
from pdserve.kv_transfer.base import KVLayout

SMOLLM2 = KVLayout("smollm2-135m", "bfloat16", 30, 16, 3, 64)


def _start(store_dir: str, dram_gb: float) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pdserve.kv_store.cli", "store", "--store-dir", store_dir,
           "--dram-gb", str(dram_gb), "--ssd-gb", "8"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    endpoint = re.search(r"listening on (\S+)", proc.stdout.readline()).group(1)  # type: ignore
    return proc, endpoint


def _caches(n: int, fill: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (n, SMOLLM2.block_size, SMOLLM2.num_kv_heads, SMOLLM2.head_dim)
    make = (lambda: torch.randn(shape).to(torch.bfloat16)) if fill else (
        lambda: torch.zeros(shape, dtype=torch.bfloat16))  # fmt: skip
    return [make() for _ in range(30)], [make() for _ in range(30)]


def measure(n: int, tier: str) -> dict[str, float]:
    """Seconds to put `n` blocks and to load them back from `tier` ("dram" or "ssd")."""
    tokens = list(range(n * SMOLLM2.block_size))
    hashes = block_hashes(tokens, SMOLLM2.block_size)
    per_block = [tokens[i * 16 : (i + 1) * 16] for i in range(n)]
    src, dst = _caches(n, True), _caches(n, False)
    with tempfile.TemporaryDirectory() as d:
        proc, endpoint = _start(d, 8 if tier == "dram" else 0)
        try:
            writer = StoreClient(endpoint, SMOLLM2, *src, timeout_s=60)
            reader = StoreClient(endpoint, SMOLLM2, *dst, timeout_s=60)
            t0 = time.perf_counter()
            ticket = writer.put(hashes, per_block, list(range(n)))
            assert ticket.wait(120) and ticket.ok, ticket.error
            put_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = reader.load(hashes, list(range(n)), timeout_s=120)
            load_s = time.perf_counter() - t0
            pairs = zip([*src[0], *src[1]], [*dst[0], *dst[1]], strict=True)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs)
            assert got == n and same, f"loaded {got} of {n}, bit-identical: {same}"
            writer.close()
            reader.close()
        finally:
            proc.terminate()
            proc.wait(10)
    return {"put_s": put_s, "load_s": load_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256, help="blocks per run (default 256)")
    args = parser.parse_args(argv)
    mb = args.blocks * payload_bytes(SMOLLM2) / 1e6
    print(f"{args.blocks} blocks x {payload_bytes(SMOLLM2)} B = {mb:.1f} MB (SmolLM2-135M bf16)")
    for tier in ("dram", "ssd"):
        r = measure(args.blocks, tier)
        print(f"{tier:4}: put {mb / r['put_s']:7.0f} MB/s  load {mb / r['load_s']:7.0f} MB/s "
              f"({1e3 * r['load_s'] / args.blocks:.3f} ms/block), bit-identical")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
