"""The multi-turn deployment of `benchmarks/kv_store.py --hosts` on network hosts
(bench/netns.py): the router, the prefill worker, the decode worker and the KV store (a `pdserve
store`, or a Mooncake Store pool's `mooncake_master`) each on a host of its own, the client on
another. Every block a worker loads from the store crosses a link: from the store's host, or
with Mooncake from the segment of the worker that offloaded it (each worker contributes DRAM to
the pool from its own host, bound to its address: MC_TCP_BIND_ADDRESS and host=)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from _kv_load import start_pool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from servers import Command  # noqa: E402

from pdserve.launch.local import ServePlan  # noqa: E402

HOSTS = ("router", "prefill", "decode", "store", "client")
HTTP_PORT, CONTROL_PORT, STORE_PORT = 8000, 7000, 7300
STORE_DRAM_GB = 1.0  # `pdserve serve --kv-store`'s default --store-dram-gb, as on loopback


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


@contextmanager
def deployment(net, backend: str | None, engine: tuple[str, ...]) -> Iterator[str]:
    """Start the router and a prefill and a decode worker (`engine`: their flags; each pinned
    to the cores `pdserve serve` would give it) on their hosts of `net` (HOSTS), with the KV
    store `backend` ("pdserve", "mooncake" or None: off) on its own; yield the router's URL
    (/v1) once both workers serve, and stop them all on exit."""
    hosts, env = net.hosts, {"PDSERVE_SECRET": secrets.token_hex(16)}
    router = hosts["router"].address
    with ExitStack() as stack:
        endpoint = None
        if backend:
            pool, endpoint = start_pool(backend, hosts["store"], STORE_PORT, {**os.environ, **env},
                                        STORE_DRAM_GB)  # fmt: skip
            stack.callback(_stop, pool)
        stack.enter_context(Command(
            "router", "--host", router, "--port", str(HTTP_PORT), "--control-host", router,
            "--control-port", str(CONTROL_PORT), "--mode", "disagg", ready=r"router on http://",
            env=env, prefix=hosts["router"].prefix(),
        ))  # fmt: skip
        plan = ServePlan.make("disagg", 1, 1, 1, sorted(os.sched_getaffinity(0)))
        for role, cpus in plan.workers:
            host = hosts[role]
            argv = ["worker", "--role", role, "--worker-id", role, "--cpus", cpus,
                    "--router", f"tcp://{router}:{CONTROL_PORT}", "--kv-host", host.address,
                    *engine]  # fmt: skip
            worker_env = dict(env)
            if backend == "mooncake":
                argv += ["--kv-store", f"{endpoint}&host={host.address}"]
                worker_env["MC_TCP_BIND_ADDRESS"] = host.address
            elif endpoint:
                argv += ["--kv-store", endpoint]
            stack.enter_context(Command(*argv, ready=r"worker \w+ \(\w+\) ready", env=worker_env,
                                        prefix=host.prefix(), startup_timeout_s=300))  # fmt: skip
        url = f"http://{router}:{HTTP_PORT}"
        _wait_workers(hosts["client"], url, {role for role, _ in plan.workers})
        yield url + "/v1"


def _wait_workers(client, url: str, ids: set[str], timeout_s: float = 120) -> None:
    """Until the router's /health, asked from the client host, lists workers `ids`."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = client.call(httpx.get, url + "/health", timeout=10)
        if reply.status_code == 200 and set(reply.json().get("workers", {})) == ids:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers {sorted(ids)} did not register with {url}: {reply.text}")
        time.sleep(0.5)
