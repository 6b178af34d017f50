"""One set of network hosts for the module (bench/netns.py): a router, a prefill worker, a
decode worker and a KV store each on a host of its own, and a client host, set up as the
multi-host recipe in docs/serving.md says (its addresses, ports and secret). Skips where network
namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import secrets
import tempfile
import threading

import httpx
import pytest
from servers import Command, unclean
from waiting import wait_until

from pdserve.bench import netns

if why := netns.unavailable():
    pytest.skip(f"multi-host tests need network namespaces: {why}", allow_module_level=True)

# The recipe's addresses and ports (docs/serving.md#multi-host).
ROUTER, PREFILL, DECODE, STORE = (f"{netns.SUBNET}.{i}" for i in (1, 2, 3, 4))
HTTP_PORT, CONTROL_PORT, STORE_PORT = 8000, 7000, 7300
URL = f"http://{ROUTER}:{HTTP_PORT}"
TRANSFER_TIMEOUT_S = 3.0  # the prefill worker's --transfer-timeout-s


class Cluster:
    """The hosts and the processes on them; `call` runs a function on the client host."""

    def __init__(self, net: netns.Network, procs: dict[str, Command]):
        self.net, self.procs = net, procs
        self.hosts = net.hosts

    def call(self, fn, *args, **kwargs):
        return self.hosts["client"].call(fn, *args, **kwargs)

    def get(self, path: str) -> httpx.Response:
        return self.call(httpx.get, URL + path, timeout=10)

    def complete(self, body: dict, timeout_s: float = 120) -> dict:
        reply = self.call(httpx.post, URL + "/v1/completions", json=body, timeout=timeout_s)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def metric(self, name: str) -> float:
        """Sum of a router metric's samples (0 when never incremented)."""
        total = 0.0
        for line in self.get("/metrics").text.splitlines():
            if line.startswith((name + " ", name + "{")):
                total += float(line.split()[-1])
        return total

    def workers(self) -> dict:
        return self.get("/health").json()["workers"]

    def wait_clean(self, timeout_s: float = 30) -> dict:
        """Both workers registered, idle, every block free."""
        seen: dict = {}

        def clean():
            nonlocal seen
            reply = self.get("/health")
            seen = reply.json().get("workers", {}) if reply.status_code == 200 else {}
            return set(seen) == {"p0", "d0"} and not unclean(seen)

        wait_until(clean, timeout_s, "both workers idle and clean", state=lambda: unclean(seen))
        return seen


def _start(procs: dict, name: str, host: netns.Host, env: dict, *args: str, ready: str) -> None:
    procs[name] = Command(*args, ready=ready, env=env, prefix=host.prefix())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = {"PDSERVE_SECRET": secrets.token_hex(16)}  # the same on every host
    engine = ["--dtype", "float32", "--threads", "1", "--kv-cache-gb", "0.25"]
    store_dir = tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())
    procs: dict[str, Command] = {}
    with netns.Network() as net:
        hosts = {name: net.add_host(name) for name in ("router", "prefill", "decode", "store")}
        net.add_host("client")
        try:
            _start(procs, "router", hosts["router"], env, "router", "--host", ROUTER,
                   "--port", str(HTTP_PORT), "--control-host", ROUTER,
                   "--control-port", str(CONTROL_PORT), "--mode", "disagg",
                   "--local-prefill-threshold", "0", "--heartbeat-timeout-s", "3",
                   ready=r"router on http://")  # fmt: skip
            _start(procs, "store", hosts["store"], env, "store", "--host", STORE,
                   "--port", str(STORE_PORT), "--store-dir", store_dir, "--dram-gb", "0.5",
                   "--ssd-gb", "0", ready=r"pdserve store: listening")  # fmt: skip
            workers = {
                "prefill": ["--role", "prefill", "--worker-id", "p0",
                            "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)],
                "decode": ["--role", "decode", "--worker-id", "d0", "--kv-host", DECODE],
            }  # fmt: skip
            starting = [
                threading.Thread(target=_start, args=(
                    procs, role, hosts[role], env, "worker", *argv,
                    "--router", f"tcp://{ROUTER}:{CONTROL_PORT}",
                    "--kv-store", f"tcp://{STORE}:{STORE_PORT}", "--router-timeout-s", "4",
                    *engine), kwargs={"ready": r"worker \w+ \(\w+\) ready"})
                for role, argv in workers.items()
            ]  # fmt: skip
            for thread in starting:
                thread.start()
            for thread in starting:
                thread.join()
            assert set(procs) == {"router", "store", "prefill", "decode"}, "a worker did not start"
            cluster = Cluster(net, procs)
            cluster.wait_clean(60)
            yield cluster
        finally:  # all at once: each waits for its process to exit
            stopping = [threading.Thread(target=proc.stop) for proc in procs.values()]
            for thread in stopping:
                thread.start()
            for thread in stopping:
                thread.join()
