"""One set of network hosts for the package (bench/netns.py): a router, a prefill worker, a
decode worker and a KV store each on a host of its own, a second router on a host of its own
that shares both workers (active-active), and a client host, set up as the multi-host recipe in
docs/serving.md says (its addresses, ports and secret). The modules add their own processes to
these hosts (test_nixl.py: a nixl deployment; test_ray.py: a Ray cluster on two more hosts).
Skips where network namespaces cannot be made (not root, no iproute2)."""

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
ROUTER, PREFILL, DECODE, STORE, CLIENT, ROUTER2 = (f"{netns.SUBNET}.{i}" for i in range(1, 7))
HTTP_PORT, CONTROL_PORT, STORE_PORT = 8000, 7000, 7300
URL, URL2 = f"http://{ROUTER}:{HTTP_PORT}", f"http://{ROUTER2}:{HTTP_PORT}"
TRANSFER_TIMEOUT_S = 3.0  # the prefill worker's --transfer-timeout-s
ENGINE = ("--dtype", "float32", "--threads", "1", "--kv-cache-gb", "0.25")
SECRET = {"PDSERVE_SECRET": secrets.token_hex(16)}  # the same on every host


# ~300 tokens of distinct text per prompt (the prefix cache must not answer for the link)
def notes(seed: int, n: int = 24) -> str:
    return f"Summarize the following notes ({seed}). " + " ".join(
        f"Note {i}: the warehouse in district {(i * seed) % 7} shipped {i * 13 % 97} crates "
        f"on day {i + seed}." for i in range(n)
    )  # fmt: skip


MAX_TOKENS = 12


def body(prompt: str, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **extra}  # fmt: skip


class Offline:
    """The offline engine's greedy text for a prompt (each computed once), and the bundled
    model's KV bytes per token (float32 K and V, every layer)."""

    def __init__(self):
        from pdserve.engine.llm import LLM
        from pdserve.engine.sampling_params import SamplingParams

        self.llm = LLM(dtype="float32", device="cpu")
        self.params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        mc = self.llm.engine.model_config
        self.per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
        self.texts: dict[str, str] = {}

    def text(self, prompt: str) -> str:
        if prompt not in self.texts:
            self.texts[prompt] = self.llm.generate(prompt, self.params)[0].text
        return self.texts[prompt]


@pytest.fixture(scope="package")
def offline() -> Offline:
    return Offline()


class Service:
    """One router's HTTP API, called from the client host; `worker_ids`: the workers it must
    have."""

    def __init__(self, client: netns.Host, url: str, worker_ids: set[str]):
        self.client, self.url, self.worker_ids = client, url, worker_ids

    def call(self, fn, *args, **kwargs):
        return self.client.call(fn, *args, **kwargs)

    def get(self, path: str) -> httpx.Response:
        return self.call(httpx.get, self.url + path, timeout=10)

    def complete(self, body: dict, timeout_s: float = 120) -> dict:
        reply = self.call(httpx.post, self.url + "/v1/completions", json=body, timeout=timeout_s)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def text(self, prompt: str) -> str:
        return self.complete(body(prompt))["choices"][0]["text"]

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
        """Every worker registered, idle, every block free."""
        seen: dict = {}

        def clean():
            nonlocal seen
            reply = self.get("/health")
            seen = reply.json().get("workers", {}) if reply.status_code == 200 else {}
            return set(seen) == self.worker_ids and not unclean(seen)

        what = f"workers {sorted(self.worker_ids)} registered with {self.url}, idle and clean"
        wait_until(clean, timeout_s, what, state=lambda: unclean(seen) or seen)
        return seen


class Cluster(Service):
    """The hosts and the processes on them, served by the router on ROUTER; `second`: the
    router on ROUTER2, which the same two workers serve."""

    def __init__(self, net: netns.Network, procs: dict[str, Command]):
        super().__init__(net.hosts["client"], URL, {"p0", "d0"})
        self.net, self.procs = net, procs
        self.hosts = net.hosts
        self.second = Service(self.client, URL2, {"p0", "d0"})


def start_all(
    host_argv: dict[str, tuple[netns.Host, list[str], str]], env: dict[str, str] | None = None
) -> dict[str, Command]:
    """Start `pdserve ARGV` on each host at once (name -> host, argv, ready pattern), with the
    secret (and `env`); return them once all are ready, or stop those that started and raise."""
    procs: dict[str, Command] = {}
    errors: list[BaseException] = []

    def start(name: str, host: netns.Host, argv: list[str], ready: str) -> None:
        try:
            procs[name] = Command(
                *argv, ready=ready, env={**SECRET, **(env or {})}, prefix=host.prefix()
            )
        except BaseException as exc:  # noqa: BLE001 - raised below, after the others
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(n, *x)) for n, x in host_argv.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        stop_all(procs)
        raise errors[0]
    return procs


def stop_all(procs: dict[str, Command]) -> None:
    """Stop them all at once: each stop waits for its process to exit."""
    stopping = [threading.Thread(target=proc.stop) for proc in procs.values()]
    for thread in stopping:
        thread.start()
    for thread in stopping:
        thread.join()


def router_argv(address: str, http_port: int = HTTP_PORT, control_port: int = CONTROL_PORT):
    return ["router", "--host", address, "--port", str(http_port), "--control-host", address,
            "--control-port", str(control_port), "--mode", "disagg",
            "--local-prefill-threshold", "0", "--heartbeat-timeout-s", "3"]  # fmt: skip


ROUTER_READY = r"router on http://"
WORKER_READY = r"worker \w+ \(\w+\) ready"


@pytest.fixture(scope="package")
def cluster(tmp_path_factory):
    store_dir = tempfile.mkdtemp(dir=tmp_path_factory.getbasetemp())
    with netns.Network() as net:
        names = ("router", "prefill", "decode", "store", "client", "router2")
        hosts = {name: net.add_host(name) for name in names}
        assert hosts["router2"].address == ROUTER2
        routers = start_all({
            "router": (hosts["router"], router_argv(ROUTER), ROUTER_READY),
            "router2": (hosts["router2"], router_argv(ROUTER2), ROUTER_READY),
            "store": (hosts["store"], ["store", "--host", STORE, "--port", str(STORE_PORT),
                      "--store-dir", store_dir, "--dram-gb", "0.5", "--ssd-gb", "0"],
                      r"pdserve store: listening"),
        })  # fmt: skip
        procs = dict(routers)
        try:
            # each worker registers with both routers (active-active)
            common = ["--router", f"tcp://{ROUTER}:{CONTROL_PORT}",
                      "--router", f"tcp://{ROUTER2}:{CONTROL_PORT}",
                      "--kv-store", f"tcp://{STORE}:{STORE_PORT}", "--router-timeout-s", "4",
                      *ENGINE]  # fmt: skip
            procs |= start_all({
                "prefill": (hosts["prefill"], ["worker", "--role", "prefill", "--worker-id", "p0",
                            "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), *common],
                            WORKER_READY),
                "decode": (hosts["decode"], ["worker", "--role", "decode", "--worker-id", "d0",
                           "--kv-host", DECODE, *common], WORKER_READY),
            })  # fmt: skip
            cluster = Cluster(net, procs)
            cluster.wait_clean(60)
            cluster.second.wait_clean(60)
            yield cluster
        finally:
            stop_all(procs)


KV_BYTES = "pdserve_kv_transfer_bytes_total"


def assert_kv_crossed(
    service: Service, offline: Offline, prompt: str, sender: netns.Host | None,
    receiver: netns.Host,
) -> dict:  # fmt: skip
    """One greedy completion of a prompt no cache holds, through `service`: the offline text;
    the KV bytes its prefill worker reports pushing are at least the prompt's KV (whole blocks:
    a little more), and the kernels of both ends of the link count them: they left `sender`
    (None: several hosts sent them, the caller checks) and reached `receiver`. Returns the
    reply."""
    pushed, sent = service.metric(KV_BYTES), sender and sender.bytes_sent()
    received = receiver.bytes_received()
    reply = service.complete(body(prompt))
    assert reply["choices"][0]["text"] == offline.text(prompt)
    tokens, per_token = reply["usage"]["prompt_tokens"], offline.per_token
    pushed = service.metric(KV_BYTES) - pushed
    assert tokens * per_token <= pushed < (tokens + 32) * per_token, (tokens, pushed)
    if sender is not None:
        assert sender.bytes_sent() - sent >= pushed
    assert receiver.bytes_received() - received >= pushed
    return reply
