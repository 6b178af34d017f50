"""`pdserve serve --launcher ray` on a Ray cluster of three nodes on this machine
(`ray.cluster_utils.Cluster`: a head without CPUs, one node labelled pdserve/role=prefill, one
labelled pdserve/role=decode). One Ray deployment (1 P + 2 D) serves the module: it answers
greedy prompts token for token like the local launcher's (`disagg_server`), Ray places each
pool on its labelled node, and a decode actor killed -9 mid-stream costs no token: the stream
migrates, Ray restarts the actor, it registers again and serves."""

from __future__ import annotations

import os
import signal
import sys
import threading

import httpx
import pytest
import ray
from chaos.cluster import complete, stream
from ray.cluster_utils import Cluster
from servers import Server, metric, metric_sum, run_serve
from serving.test_pp_served import REMOTE
from waiting import wait_until

from launch.autoscaling import PROMPTS, at, burst, reference_texts
from pdserve.engine.pp.ray_stages import NAMESPACE, stage_actor_name

pytestmark = pytest.mark.slow
ROLE = "pdserve/role"
ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def cluster():
    os.environ.update(ENV)
    c = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 0})
    c.add_node(num_cpus=1, labels={ROLE: "prefill"})
    c.add_node(num_cpus=2, labels={ROLE: "decode"})
    c.wait_for_nodes()
    ray.init(address=c.address)  # the test's own view of where Ray put things
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="class")
def ray_server(cluster):
    with Server(
        "--launcher", "ray", "--ray-address", cluster.address, "--mode", "disagg",
        "--decode", "2", "--dtype", "float32", "--local-prefill-threshold", "0",
        "--kv-cache-gb", "0.5", env=ENV,
    ) as server:  # fmt: skip
        yield server


def answers(url: str) -> list[str]:
    """Completions and chat, streamed and not, greedy."""
    out = []
    for body in ({"prompt": "The capital of France is"}, {"messages": CHAT}):
        for call in (complete, stream):
            outcome = call(url, {**body, **GREEDY})
            assert outcome.kind == "ok", outcome
            out.append(outcome.text)
    return out


class TestOneRayDeployment:
    """One deployment (1 P + 2 D) serves these; it stops before the next tests start theirs
    (`ray_server` is class-scoped: the whole suite must fit in memory)."""

    def test_ray_deployment_answers_like_the_local_launcher(self, ray_server, disagg_server):
        assert answers(ray_server.url) == answers(disagg_server.url)
        ray_server.wait_idle_and_clean()

    def test_each_pool_runs_on_the_node_labelled_for_it(self, ray_server):
        labels = {n["NodeID"]: n["Labels"].get(ROLE) for n in ray.nodes() if n["Alive"]}
        workers = ray_server.health()["workers"]
        assert {w: labels[v["ray_node_id"]] for w, v in workers.items()} == {
            "prefill-0": "prefill", "decode-1": "decode", "decode-2": "decode"
        }  # fmt: skip
        assert all(v["ray_actor_id"] and v["pid"] for v in workers.values())

    def test_a_decode_actor_killed_mid_stream_costs_no_token_and_ray_restarts_it(self, ray_server):
        body = {"prompt": "Once upon a time", **GREEDY, "max_tokens": 80}
        expected = complete(ray_server.url, body)
        killed: list[tuple[str, int]] = []

        def kill_its_decode_worker(chunks: int) -> None:
            if chunks == 1:  # the stream is running: kill -9 the decode actor serving it
                running = wait_until(  # once a heartbeat has shown it
                    lambda: [(w, v["pid"]) for w, v in ray_server.health()["workers"].items()
                             if v.get("running") == 1],
                    10, "a heartbeat showing the stream on its decode worker",
                )  # fmt: skip
                killed.extend(running)
                os.kill(killed[0][1], signal.SIGKILL)

        out = stream(ray_server.url, body, on_chunk=kill_its_decode_worker)
        [(victim, pid)] = killed
        assert (out.kind, out.text) == ("ok", expected.text)
        back = wait_until(
            lambda: (
                (w := ray_server.health()["workers"].get(victim))
                and w["pid"] != pid
                and "prefix_query_tokens" in w  # its first load report has arrived
                and w
            ),
            120,
            f"Ray to restart {victim}, it to register again and report its load",
        )
        before = back["prefix_query_tokens"]
        for i in range(4):  # spread over both decode workers: the restarted one takes some
            httpx.post(ray_server.url + "/v1/completions",
                       json={"prompt": f"Request {i}: the sea", **GREEDY}, timeout=60)  # fmt: skip
        wait_until(
            lambda: ray_server.health()["workers"][victim]["prefix_query_tokens"] > before,
            10,
            f"the restarted {victim} to serve",
        )
        ray_server.wait_idle_and_clean()


def test_a_tensor_parallel_decode_worker_runs_in_a_placement_group_on_its_node(
    cluster, disagg_server
):
    """--decode-tp 3: the decode worker's three ranks get a placement group of three bundles
    (half a CPU each of its 1.5) packed on the node labelled for decode; it answers like the
    local launcher's TP 1 pools, and its group is removed when serve stops."""
    with Server(
        "--launcher", "ray", "--ray-address", cluster.address, "--mode", "disagg",
        "--decode-tp", "3", "--decode-resources", '{"CPU": 1.5}', "--dtype", "float32",
        "--local-prefill-threshold", "0", "--kv-cache-gb", "0.25", env=ENV,
    ) as server:  # fmt: skip
        assert answers(server.url) == answers(disagg_server.url)
        group = placement_group_of(server, "decode-1")
        assert group["state"] == "CREATED" and group["strategy"] == "STRICT_PACK"
        assert list(group["bundles"].values()) == [{"CPU": 0.5}] * 3
        decode_node = next(n["NodeID"] for n in ray.nodes() if n["Labels"].get(ROLE) == "decode")
        assert set(group["bundles_to_node_id"].values()) == {decode_node}
        server.wait_idle_and_clean()
    wait_removed(group)


def placement_group_of(server: Server, worker_id: str) -> dict:
    """The placement group the Ray launcher made for a worker of `server` (by its name)."""
    name = f"pdserve-{worker_id}-{server.proc.pid}"
    [group] = [g for g in ray.util.placement_group_table().values() if g["name"] == name]
    return group


def wait_removed(group: dict) -> None:
    def removed() -> bool:
        table = ray.util.placement_group_table()
        return table.get(group["placement_group_id"], {}).get("state") in (None, "REMOVED")

    wait_until(removed, 30, "the placement group to be removed")


def test_a_prefill_pipeline_spans_two_nodes_each_stage_pushing_its_own_layers(
    cluster, disagg_server
):
    """--prefill-pp 2 with 2 CPUs on nodes of 1 CPU labelled prefill (a second one joins for
    this test): the worker's placement group (PACK, a CPU a bundle) spans both nodes, stage 1
    runs as an actor on the other node, without shared memory, pushing its own layers; the
    answers are the local launcher's, and the group is removed when serve stops."""
    node = cluster.add_node(num_cpus=1, labels={ROLE: "prefill"})
    cluster.wait_for_nodes()
    try:
        with Server(
            "--launcher", "ray", "--ray-address", cluster.address, "--mode", "disagg",
            "--prefill-pp", "2", "--prefill-resources", '{"CPU": 2}', "--dtype", "float32",
            "--local-prefill-threshold", "0", "--kv-cache-gb", "0.25", env=ENV,
        ) as server:  # fmt: skip
            assert answers(server.url) == answers(disagg_server.url)
            group = placement_group_of(server, "prefill-0")
            assert group["state"] == "CREATED" and group["strategy"] == "PACK"
            assert list(group["bundles"].values()) == [{"CPU": 1.0}] * 2
            prefill = {n["NodeID"] for n in ray.nodes() if n["Labels"].get(ROLE) == "prefill"}
            assert set(group["bundles_to_node_id"].values()) == prefill  # one stage on each
            worker = server.health()["workers"]["prefill-0"]
            name = stage_actor_name(1, worker["ray_actor_id"], worker["pid"])
            stage = ray.get_actor(name, NAMESPACE)
            assert ray.get(stage.node_id.remote()) == group["bundles_to_node_id"][1]
            assert worker["ray_node_id"] == group["bundles_to_node_id"][0]
            kv = metric_sum(server.url, "pdserve_kv_transfer_bytes_total")
            assert kv > 0 and metric(server.url, REMOTE) >= 4  # every answer pushed from P
            server.wait_idle_and_clean()
        wait_removed(group)
    finally:
        cluster.remove_node(node)


def test_a_worker_that_cannot_start_fails_the_start_up_with_its_error(cluster):
    """A worker whose engine refuses its flags is reported with the worker's own error, and
    serve exits: Ray does not restart it forever."""
    out = run_serve("--launcher", "ray", "--ray-address", cluster.address, "--mode", "disagg",
                    "--prefill", "0", "--decode-resources", '{"CPU": 0}',  # fits beside ray_server
                    "--decode-args", "--max-num-seqs 0", env=ENV)  # fmt: skip
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "worker decode-0 failed to start" in text and "max_num_seqs" in text, text[-3000:]


def test_without_ray_installed_the_launcher_says_how_to_install_it(monkeypatch):
    from pdserve.launch import ray_launcher

    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed
    with pytest.raises(SystemExit, match=r"pip install 'pdserve\[ray\]'"):
        ray_launcher.import_ray()


def test_an_actor_ray_is_restarting_during_start_up_is_not_a_failed_start():
    """Its process died (e.g. Ray's memory monitor) and Ray restarts it: serve waits for it;
    an actor that is gone for good, or a worker that reported an error, fails the start-up."""
    from pdserve.launch.ray_launcher import RayWorkers

    class Actor:
        def __init__(self, answer):
            self.answer = answer
            self.info = self

        def remote(self):
            return self.answer

    class FakeRay:
        exceptions = ray.exceptions

        @staticmethod
        def wait(refs, timeout):
            return refs, []

        @staticmethod
        def get(ref):
            if isinstance(ref, Exception):
                raise ref
            return ref

    workers = object.__new__(RayWorkers)
    workers.ray, workers.pending = FakeRay, {}
    restarting = ray.exceptions.ActorUnavailableError("the actor is restarting", None)
    workers.actors = {"p0": Actor({"error": None})}
    workers.info_refs = {"p0": restarting}
    assert workers.failed() is None
    workers.info_refs = {"p0": ray.exceptions.ActorDiedError()}
    assert workers.failed()[0] == "p0"
    workers.info_refs = {"p0": {"error": "ValueError: max_num_seqs"}}
    assert workers.failed() == ("p0", "ValueError: max_num_seqs")


def test_the_autoscaler_adds_and_drains_ray_actors(cluster):
    """--autoscale with --launcher ray: a burst makes it start a worker as a new actor, which
    registers and serves; after the cooldown it is drained and its actor removed (Ray no longer
    knows it by name). Every request has the greedy text of an undisturbed run."""
    with Server(
        "--launcher", "ray", "--ray-address", cluster.address, "--mode", "disagg",
        "--prefill-resources", '{"CPU": 0}', "--decode-resources", '{"CPU": 0}',  # fits
        "--dtype", "float32", "--kv-cache-gb", "0.25", "--autoscale", "--max-prefill", "2",
        "--max-decode", "2", "--slo-ttft", "3", "--slo-tpot", "0.25", "--scale-interval", "1",
        "--scale-cooldown", "5", env=ENV,
    ) as server:  # fmt: skip
        expected = reference_texts(server.url, PROMPTS[:8])
        wait_until(lambda: at(server, 1, 1), 60, "1P+1D before the burst")
        before = set(server.health()["workers"])
        stop = threading.Event()
        threads, out = burst(server.url, PROMPTS[:8], stop)  # until a new actor registers
        try:
            added = wait_until(lambda: set(server.health()["workers"]) - before, 180,
                               "a new actor to register", state=server.health)  # fmt: skip
        finally:
            stop.set()
            for t in threads:
                t.join(300)
        assert {p: set(texts) for p, texts in out.items()} == {p: {expected[p]} for p in out}
        wait_until(lambda: at(server, 1, 1) and not added & set(server.health()["workers"]), 90,
                   "the added workers to drain and leave", state=server.health)  # fmt: skip

        def actor_gone(wid: str) -> bool:
            try:
                ray.get_actor(f"pdserve-{wid}-{server.proc.pid}")
            except ValueError:
                return True
            return False

        wait_until(lambda: all(actor_gone(w) for w in added), 30, "Ray to drop their actors")
        server.wait_idle_and_clean()
