"""`pdserve serve --launcher ray` across hosts: a Ray head on one host (labelled
pdserve/role=prefill) and a Ray worker node on another (pdserve/role=decode), each bound to its
host's address (--node-ip-address), added to the package's network; `serve` on the head host
with its router's HTTP and control sockets on the head's address. Ray places the prefill worker
on the head and the decode worker on the node, the KV crosses between them, a decode worker
killed -9 is restarted by Ray on its node and serves the same text, and stopping serve and Ray
leaves no process on either host. One Ray cluster serves the module (docs/serving.md#multi-host)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest
from servers import READY, Command
from waiting import wait_until

from pdserve.bench import netns

from .conftest import SECRET, Service, assert_kv_crossed, notes

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="--launcher ray needs Ray: pip install 'pdserve[ray]' (ray==2.60.0)",
)
RAY_HEAD, RAY_NODE = f"{netns.SUBNET}.7", f"{netns.SUBNET}.8"
RAY_PORT, HTTP_PORT, CONTROL_PORT = 6379, 8000, 7000
ROLE = "pdserve/role"
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
WORKERS = {"prefill-0": "rayhead", "decode-1": "raynode"}  # worker id -> the host Ray must use


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

    def __init__(self, cluster, head: netns.Host, node: netns.Host, serve: Command):
        super().__init__(cluster.client, f"http://{RAY_HEAD}:{HTTP_PORT}", set(WORKERS))
        self.head, self.node, self.serve = head, node, serve

    def where(self) -> dict[str, str]:
        """Worker id -> the Ray host its process runs on."""
        hosts = {pid: h.name for h in (self.head, self.node) for pid in h.pids()}
        return {w: hosts.get(v["pid"], "elsewhere") for w, v in self.workers().items()}

    def stop(self) -> list[int]:
        self.serve.stop()
        return stop_ray(self.node) + stop_ray(self.head)


@pytest.fixture(scope="module")
def ray_serve(cluster):
    head, node = cluster.net.add_host("rayhead"), cluster.net.add_host("raynode")
    assert (head.address, node.address) == (RAY_HEAD, RAY_NODE)
    temp = tempfile.mkdtemp(prefix="pdray")
    deployment = None
    try:
        ray_start(head, f"{temp}/head", "prefill", "--head", "--port", str(RAY_PORT),
                  "--include-dashboard", "false")  # fmt: skip
        ray_start(node, f"{temp}/node", "decode", "--address", f"{RAY_HEAD}:{RAY_PORT}")
        serve = Command(
            "serve", "--launcher", "ray", "--ray-address", f"{RAY_HEAD}:{RAY_PORT}",
            "--host", RAY_HEAD, "--port", str(HTTP_PORT), "--control-host", RAY_HEAD,
            "--control-port", str(CONTROL_PORT), "--mode", "disagg", "--prefill", "1",
            "--decode", "1", "--local-prefill-threshold", "0", "--dtype", "float32",
            "--kv-cache-gb", "0.25", ready=READY.pattern, env={**SECRET, **RAY_ENV},
            prefix=head.prefix(), startup_timeout_s=240,
        )  # fmt: skip
        deployment = RayDeployment(cluster, head, node, serve)
        yield deployment
    finally:
        if deployment is not None:
            deployment.serve.stop()
        stop_ray(node)
        stop_ray(head)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_places_each_pool_on_its_labelled_host_and_serves_the_offline_text(ray_serve, offline):
    ray_serve.wait_clean(60)
    assert ray_serve.where() == WORKERS
    assert_kv_crossed(ray_serve, offline, notes(21), ray_serve.head, ray_serve.node)
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
    assert ray_serve.where() == WORKERS  # again on the node labelled decode
    wait_until(lambda: any("restarted by Ray" in x for x in ray_serve.serve.lines), 30,
               "serve to report the restart")  # fmt: skip
    prompt = notes(21)  # the first test's: the same text from the restarted worker
    assert ray_serve.text(prompt) == offline.text(prompt)
    assert_kv_crossed(ray_serve, offline, notes(22), ray_serve.head, ray_serve.node)
    ray_serve.wait_clean()


def test_stopping_serve_and_ray_leaves_no_process_on_either_host(ray_serve):
    assert ray_serve.stop() == []  # each exited on SIGTERM, none needed SIGKILL
    assert ray_serve.head.pids() == [] and ray_serve.node.pids() == []
