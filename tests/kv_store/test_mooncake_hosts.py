"""A Mooncake pool across hosts (network namespaces, bench/netns.py): `mooncake_master` and the
router on one host, a `pdserve worker` on each of two others, each contributing DRAM to the pool
(docs/serving.md, the cross-host recipe). Blocks the first worker offloaded (into its own
segment: it is alone in the pool then) are loaded by the second with the greedy text of the
cold run, and their bytes crossed from the first worker's host to the second's. Skipped,
saying why, without root and iproute2 or without the Mooncake wheel and its libibverbs."""

from __future__ import annotations

import secrets
import socket
import subprocess

import httpx
import pytest
from servers import Command, unclean
from serving.test_kv_store_serving import SYSTEM
from waiting import wait_until

from pdserve.bench import netns
from pdserve.kv_store import mooncake_setup

from .helpers import MOONCAKE_SKIP

SKIP = MOONCAKE_SKIP or netns.unavailable()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=f"Mooncake across hosts: {SKIP}")

MASTER, W1, W2 = (f"{netns.SUBNET}.{i}" for i in (1, 2, 3))  # the order hosts are added in
MASTER_PORT, METRICS_PORT, HTTP_PORT, CONTROL_PORT = 7400, 7401, 8000, 7000
URL = f"http://{MASTER}:{HTTP_PORT}"
POOL = f"mooncake://{MASTER}:{MASTER_PORT}?segment_mb=128&buffer_mb=16"
ENGINE = ("--dtype", "float32", "--threads", "1", "--no-prefix-caching")  # hits: pool only
BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers x (K, V) x KV heads x dim x fp32


class Pool:
    """The hosts, the master, the router and the workers started so far."""

    def __init__(self, net: netns.Network, env: dict[str, str]):
        self.net, self.env = net, env
        self.hosts = net.hosts
        self.procs: list[Command] = []

    def worker(self, worker_id: str, host: str, *flags: str) -> None:
        """A worker on `host` in the pool, its transfer ports bound to its address only."""
        address = self.hosts[host].address
        env = {**self.env, "MC_TCP_BIND_ADDRESS": address}
        self.procs.append(Command(
            "worker", "--role", "both", "--worker-id", worker_id,
            "--router", f"tcp://{MASTER}:{CONTROL_PORT}", "--kv-store", f"{POOL}&host={address}",
            *ENGINE, *flags, ready=r"worker \w+ \(\w+\) ready", env=env,
            prefix=self.hosts[host].prefix(),
        ))  # fmt: skip

    def get(self, path: str) -> httpx.Response:
        return self.hosts["master"].call(httpx.get, URL + path, timeout=10)

    def complete(self, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reply = self.hosts["master"].call(httpx.post, URL + "/v1/completions", json=body,
                                          timeout=120)  # fmt: skip
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    def wait_clean(self, ids: set[str], timeout_s: float = 60) -> dict:
        """Workers `ids` registered, idle, every block free (offloads done)."""
        seen: dict = {}

        def clean() -> bool:
            nonlocal seen
            seen = self.get("/health").json().get("workers", {})
            return set(seen) == ids and not unclean(seen)

        wait_until(clean, timeout_s, f"workers {sorted(ids)} idle and clean",
                   state=lambda: (sorted(seen), unclean(seen)))  # fmt: skip
        return seen


def _listening(host: netns.Host, address: str, port: int) -> bool:
    def probe() -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex((address, port)) == 0

    return host.call(probe)


@pytest.fixture(scope="module")
def pool():
    env = {"PDSERVE_SECRET": secrets.token_hex(16)}
    with netns.Network() as net:
        for name in ("master", "w1", "w2"):
            net.add_host(name)
        master = net.hosts["master"]
        cmd = mooncake_setup.master_command(MASTER, MASTER_PORT, METRICS_PORT, client_ttl_s=5)
        mc = master.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        p = Pool(net, env)
        try:
            wait_until(lambda: _listening(master, MASTER, MASTER_PORT), 20,
                       "mooncake_master listening on its host")  # fmt: skip
            p.procs.append(Command(
                "router", "--host", MASTER, "--port", str(HTTP_PORT), "--control-host", MASTER,
                "--control-port", str(CONTROL_PORT), "--mode", "colocated",
                "--heartbeat-timeout-s", "5", ready=r"router on http://", env=env,
                prefix=master.prefix(),
            ))  # fmt: skip
            yield p
        finally:
            for proc in reversed(p.procs):
                proc.stop()
            mc.kill()
            mc.wait(10)


def test_blocks_one_host_offloaded_are_loaded_on_another_with_the_cold_text(pool):
    pool.worker("w1", "w1", "--kv-cache-gb", "0.25")
    pool.wait_clean({"w1"})
    prompt = SYSTEM + "\nUser: When does zone 4 ship?\nAssistant:"
    cold = pool.complete(prompt)  # computed on w1 (the pool is empty), then offloaded
    pool.wait_clean({"w1"})  # its blocks are held until the pool has them
    # the larger cache: more free blocks, so placement (equal store hits) picks w2
    pool.worker("w2", "w2", "--kv-cache-gb", "0.5")
    pool.wait_clean({"w1", "w2"})
    w1, w2 = pool.hosts["w1"], pool.hosts["w2"]
    sent, received = w1.bytes_sent(), w2.bytes_received()
    assert pool.complete(prompt) == cold
    pool.wait_clean({"w1", "w2"})

    def hits(worker_id: str) -> int:  # as the worker's latest load report has it
        return pool.get("/health").json()["workers"][worker_id].get("store_hit_tokens", 0)

    # the reports come every heartbeat: an idle, clean worker may not have sent this one yet
    hit_tokens = wait_until(lambda: hits("w2") >= 512 and hits("w2"), 30, "w2's store hits")
    assert hits("w1") == 0
    crossed = hit_tokens * BYTES_PER_TOKEN  # the loaded blocks' bytes, w1's host -> w2's
    assert w1.bytes_sent() - sent >= crossed and w2.bytes_received() - received >= crossed
