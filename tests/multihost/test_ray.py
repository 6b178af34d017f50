"""`pdserve serve --launcher ray` across hosts: a Ray head on one host (labelled
pdserve/role=prefill), a Ray worker node on another (pdserve/role=decode) and a third node
(pdserve/role=prefill), each bound to its host's address (--node-ip-address), added to the
package's network; `serve` on the head host with its router's HTTP and control sockets on the
head's address. The prefill worker is a pipeline of 2 stages (`--prefill-pp 2`, a CPU each):
Ray places stage 0 on the head and stage 1 on the third host, each pushes its own layers'
KV from its own host to the decode worker, which Ray places on the node; a decode worker killed
-9 is restarted by Ray on its node and serves the same text, and stopping serve and Ray leaves
no process on any host. One Ray cluster serves the module (docs/serving.md#multi-host)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
from servers import READY, Command, cmdline
from waiting import wait_until

from pdserve.bench import netns

from .conftest import SECRET, Service, assert_kv_crossed, notes

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="--launcher ray needs Ray: pip install 'pdserve[ray]' (ray==2.60.0)",
)
RAY_HEAD, RAY_NODE, RAY_STAGE = (f"{netns.SUBNET}.{i}" for i in (7, 8, 9))
RAY_PORT, HTTP_PORT, CONTROL_PORT = 6379, 8000, 7000
ROLE = "pdserve/role"
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
WORKERS = {"prefill-0", "decode-1"}


def ray_start(host: netns.Host, temp_dir: str, role: str, *args: str) -> None:
    """`ray start` on `host`, bound to its address, one CPU, labelled for `role`; its own temp
    dir (a short path: Ray's unix sockets live there)."""
    ray = str(Path(sys.executable).with_name("ray"))
    host.run([ray, "start", "--node-ip-address", host.address, "--num-cpus", "1",
              "--labels", f"{ROLE}={role}", "--object-store-memory", str(100 << 20),
              "--disable-usage-stats", "--temp-dir", temp_dir, *args])  # fmt: skip


def stop_ray(host: netns.Host) -> list[int]:
    """What `ray stop` does on a host, in its order, but only to this host's processes (`ray
    stop` finds Ray's processes by name on the whole machine: it would stop every Ray on it)."""
    return host.terminate(first=("raylet",), last=("gcs_server",))


class RayDeployment(Service):
    """`serve --launcher ray` on the head host; `stop()` stops it, then every process on both
    Ray hosts, and returns the pids that needed SIGKILL."""

    def __init__(self, cluster, hosts: list[netns.Host], serve: Command):
        super().__init__(cluster.client, f"http://{RAY_HEAD}:{HTTP_PORT}", set(WORKERS))
        self.hosts, self.serve = hosts, serve
        self.head, self.node, self.stage = hosts

    def where(self) -> dict[str, str]:
        """Worker id -> the Ray host its process runs on."""
        hosts = {pid: h.name for h in self.hosts for pid in h.pids()}
        return {w: hosts.get(v["pid"], "elsewhere") for w, v in self.workers().items()}

    def placed(self) -> tuple[netns.Host, netns.Host]:
        """(stage 0's host, stage 1's): the two hosts labelled prefill, one stage on each, and
        the decode worker on the host labelled decode."""
        where = self.where()
        assert where["decode-1"] == "raynode", where
        [first] = [h for h in (self.head, self.stage) if h.name == where["prefill-0"]]
        [second] = [h for h in (self.head, self.stage) if h is not first]
        assert any("ray::StageActor" in " ".join(cmdline(p)) for p in second.pids())
        return first, second

    def stop(self) -> list[int]:
        self.serve.stop()
        return [pid for host in reversed(self.hosts) for pid in stop_ray(host)]


@pytest.fixture(scope="module")
def ray_serve(cluster):
    hosts = [cluster.net.add_host(name) for name in ("rayhead", "raynode", "raystage")]
    head, node, stage = hosts
    assert [h.address for h in hosts] == [RAY_HEAD, RAY_NODE, RAY_STAGE]
    temp = tempfile.mkdtemp(prefix="pdray")
    deployment = None
    try:
        ray_start(head, f"{temp}/head", "prefill", "--head", "--port", str(RAY_PORT),
                  "--include-dashboard", "false")  # fmt: skip
        ray_start(node, f"{temp}/node", "decode", "--address", f"{RAY_HEAD}:{RAY_PORT}")
        ray_start(stage, f"{temp}/stage", "prefill", "--address", f"{RAY_HEAD}:{RAY_PORT}")
        serve = Command(
            "serve", "--launcher", "ray", "--ray-address", f"{RAY_HEAD}:{RAY_PORT}",
            "--host", RAY_HEAD, "--port", str(HTTP_PORT), "--control-host", RAY_HEAD,
            "--control-port", str(CONTROL_PORT), "--mode", "disagg", "--prefill", "1",
            "--decode", "1", "--local-prefill-threshold", "0", "--dtype", "float32",
            "--prefill-pp", "2", "--prefill-resources", '{"CPU": 2}',
            "--kv-cache-gb", "0.25", ready=READY.pattern, env={**SECRET, **RAY_ENV},
            prefix=head.prefix(), startup_timeout_s=240,
        )  # fmt: skip
        deployment = RayDeployment(cluster, hosts, serve)
        yield deployment
    finally:
        if deployment is not None:
            deployment.serve.stop()
        for host in reversed(hosts):
            stop_ray(host)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_places_each_pool_on_its_labelled_host_and_serves_the_offline_text(ray_serve, offline):
    ray_serve.wait_clean(60)
    hosts = ray_serve.placed()
    sent = [h.bytes_sent() for h in hosts]
    reply = assert_kv_crossed(ray_serve, offline, notes(21), None, ray_serve.node)
    # each stage pushed its own 15 of the 30 layers from its own host: half the KV left each
    half = reply["usage"]["prompt_tokens"] * offline.per_token // 2
    sent = [h.bytes_sent() - before for h, before in zip(hosts, sent, strict=True)]
    assert min(sent) >= half, (sent, half)
    ray_serve.wait_clean()


def test_a_decode_worker_killed_on_its_node_is_restarted_by_ray_and_serves_the_same_text(
    ray_serve, offline
):
    victim = ray_serve.wait_clean(60)["decode-1"]["pid"]
    os.kill(victim, signal.SIGKILL)

    def restarted() -> bool:
        reply = ray_serve.get("/health")
        worker = reply.json().get("workers", {}).get("decode-1", {})
        return worker.get("pid", victim) != victim

    wait_until(restarted, 180, "Ray to restart decode-1 and it to register again",
               state=lambda: ray_serve.serve.lines[-10:])  # fmt: skip
    ray_serve.wait_clean(60)
    ray_serve.placed()  # again on the node labelled decode
    wait_until(lambda: any("restarted by Ray" in x for x in ray_serve.serve.lines), 30,
               "serve to report the restart")  # fmt: skip
    prompt = notes(21)  # the first test's: the same text from the restarted worker
    assert ray_serve.text(prompt) == offline.text(prompt)
    assert_kv_crossed(ray_serve, offline, notes(22), None, ray_serve.node)
    ray_serve.wait_clean()


def test_stopping_serve_and_ray_leaves_no_process_on_any_host(ray_serve):
    assert ray_serve.stop() == []  # each exited on SIGTERM, none needed SIGKILL
    assert [h.pids() for h in ray_serve.hosts] == [[], [], []]
