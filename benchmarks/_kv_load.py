"""Load throughput per block of the KV store backends (`benchmarks/kv_store.py --load`).

One process puts `--blocks` blocks of SmolLM2-135M's bf16 layout (30 layers, 16 tokens, 3 KV
heads of 64: 360 KiB a block) into the store; another loads them all in one `load` call,
`--repeats` times, each way its client can (Mooncake: through its staging buffer, and straight
into the registered cache as a load under an engine step does), checking the bytes. Backends:
a `pdserve store` and a Mooncake pool; on one host (loopback) or, with `--hosts`, across
network hosts (bench/netns.py: the store or master on one, the putter on a second, the loader
on a third).

    python benchmarks/_kv_load.py ENDPOINT put N      # prints "ready", holds until stdin closes
    python benchmarks/_kv_load.py ENDPOINT load N R   # prints {"mode": [seconds per call]}
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.block_hash import block_hashes  # noqa: E402
from pdserve.kv_store.config import payload_bytes  # noqa: E402
from pdserve.kv_store.mooncake import MooncakeStoreClient, open_store_client  # noqa: E402
from pdserve.kv_transfer.layout import KVLayout  # noqa: E402

LAYOUT = KVLayout("bench-smollm2", "bfloat16", 30, 16, 3, 64)
SHAPE = (LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def caches(n: int, fill: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K and V per layer of `n` blocks: seeded random bytes (the same in every process), or
    zeros."""
    rng = np.random.default_rng(0)

    def one() -> torch.Tensor:
        t = torch.zeros((n, *SHAPE), dtype=torch.bfloat16)
        if fill:
            t.view(torch.uint8).reshape(-1)[:] = torch.from_numpy(
                rng.integers(0, 256, t.numel() * 2, dtype=np.uint8)
            )
        return t

    return [one() for _ in range(LAYOUT.num_layers)], [one() for _ in range(LAYOUT.num_layers)]


def chain(n: int) -> tuple[list[int], list[list[int]]]:
    bs = LAYOUT.block_size
    tokens = list(range(1000, 1000 + n * bs))
    return block_hashes(tokens, bs), [tokens[i * bs : (i + 1) * bs] for i in range(n)]


def put(endpoint: str, n: int) -> None:
    k, v = caches(n, fill=True)
    client = open_store_client(endpoint, LAYOUT, k, v)
    hashes, tokens = chain(n)
    ticket = client.put(hashes, tokens, list(range(n)))
    client.flush(120)
    assert ticket.done() and ticket.ok, f"the put failed: {client.last_error}"
    print("ready", flush=True)
    sys.stdin.read()  # its DRAM stays in the pool until then
    client.close()


def load(endpoint: str, n: int, repeats: int) -> None:
    k, v = caches(n, fill=False)
    want_k, want_v = caches(n, fill=True)
    client = open_store_client(endpoint, LAYOUT, k, v)
    hashes, tokens = chain(n)
    modes = {"load": {}}
    if isinstance(client, MooncakeStoreClient):
        modes = {"staged": {}, "zero-copy": {"into_cache": True}}
    out = {}
    for mode, kw in modes.items():
        for t in (*k, *v):
            t.zero_()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            landed = client.load(hashes, list(range(n)), 60, tokens, **kw)
            times.append(time.perf_counter() - start)
            assert landed == n, f"{mode}: {landed} of {n} blocks landed ({client.last_error})"
        same = (torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # NaN bit patterns too
                for a, b in zip(k + v, want_k + want_v, strict=True))  # fmt: skip
        assert all(same), f"{mode}: the loaded bytes differ from the stored ones"
        out[mode] = times
    print(json.dumps(out), flush=True)
    client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((address, port)) == 0


def _wait(check, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {timeout_s:g} s")
        time.sleep(0.2)


def start_pool(backend: str, host, port: int, env: dict, dram_gb: float,
               query: str = "") -> tuple[subprocess.Popen, str]:  # fmt: skip
    """Start `backend`'s server at `port` on `host` (a netns.Host, or None: loopback): a
    `pdserve store` of `dram_gb` DRAM (no SSD tier), or a `mooncake_master` whose clients each
    contribute `dram_gb` to its pool (`query`: more mooncake:// options). Once it listens, its
    process and the endpoint its clients are given."""
    from pdserve.kv_store import mooncake_setup

    addr = host.address if host else "127.0.0.1"
    if backend == "mooncake":
        cmd = mooncake_setup.master_command(addr, port, port + 1 if host else _free_port())
        endpoint = f"mooncake://{addr}:{port}?segment_mb={round(dram_gb * 1024)}{query}"
    else:
        store_dir = tempfile.mkdtemp(prefix="pdserve-bench-store-")
        cmd = [sys.executable, "-m", "pdserve.cli", "store", "--host", addr, "--port", str(port),
               "--store-dir", store_dir, "--dram-gb", str(dram_gb), "--ssd-gb", "0"]  # fmt: skip
        endpoint = f"tcp://{addr}:{port}"
    proc = subprocess.Popen([*(host.prefix() if host else []), *cmd], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    probe = host.call if host else (lambda fn, *a: fn(*a))
    try:
        _wait(lambda: probe(_listening, addr, port), f"{backend} listening on {addr}:{port}")
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return proc, endpoint


def measure(backend: str, n: int, repeats: int, hosts=None) -> dict[str, list[float]]:
    """Start the backend's server, a putter and a loader (each on a host of `hosts`, a dict
    pool/putter/loader -> netns.Host, or all on loopback); the loader's seconds per call."""
    where = {role: (hosts[role].prefix() if hosts else []) for role in ("putter", "loader")}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_SECRET": secrets.token_hex(16)}
    pool, endpoint = start_pool(backend, hosts and hosts["pool"], 7500 if hosts else _free_port(),
                                env, 0.25, "&buffer_mb=64&zero_copy=1")  # fmt: skip
    started = [pool]
    me = [sys.executable, __file__, endpoint]
    try:
        putter = subprocess.Popen([*where["putter"], *me, "put", str(n)], env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL)  # fmt: skip
        started.append(putter)
        assert putter.stdout.readline().strip() == "ready", f"the {backend} putter failed"
        done = subprocess.run([*where["loader"], *me, "load", str(n), str(repeats)], env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"the {backend} loader failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        for proc in reversed(started):
            proc.kill()
            proc.wait(10)


def rows(n: int, repeats: int, hosts=None) -> list[tuple[str, str, float, float]]:
    """(backend, mode, median ms per block, MB/s) for both backends."""
    out = []
    for backend in ("pdserve store", "mooncake"):
        for mode, times in measure(backend.split()[-1], n, repeats, hosts).items():
            med = float(np.median(times))
            out.append((backend, mode, med / n * 1e3, n * payload_bytes(LAYOUT) / med / 1e6))
    return out


if __name__ == "__main__":
    endpoint, role, *rest = sys.argv[1:]
    if role == "put":
        put(endpoint, int(rest[0]))
    else:
        load(endpoint, int(rest[0]), int(rest[1]))
