"""pdserve across network hosts (Linux network namespaces, bench/netns.py): the router, the
prefill worker, the decode worker and the KV store each on a host of its own, the KV crossing a
real (virtual) link. The greedy text is the offline engine's; the KV bytes the prefill worker
reports are the bytes that left its host and reached the decode host; a second router on a
host of its own serves with the same workers (active-active); a partition of the decode
host mid-stream ends the stream with a clear error and leaks nothing once healed; a link cut to
10 Mbit/s makes the push give up after --transfer-timeout-s and the decode worker prefill the
prompt itself (docs/serving.md); 50 ms of delay and 5 % loss on the prefill link slow the push
and lose nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
from waiting import wait_until

from .conftest import TRANSFER_TIMEOUT_S, URL, assert_kv_crossed, body, notes

PROMPTS = [notes(1), notes(2), notes(3, 32), notes(5)]


def test_greedy_text_across_hosts_is_the_offline_one_and_kv_bytes_cross_the_link(cluster, offline):
    prefill, decode = cluster.hosts["prefill"], cluster.hosts["decode"]
    assert_kv_crossed(cluster, offline, PROMPTS[0], prefill, decode)
    workers = cluster.wait_clean()
    assert workers["d0"]["role"] == "decode" and workers["p0"]["role"] == "prefill"


def test_a_second_router_on_its_own_host_serves_with_the_same_workers(cluster, offline):
    """Active-active across hosts: p0 and d0 took --router twice and registered with both
    routers; the second serves clients on the client host the offline text, its KV pushed from
    the prefill host to the decode host, and requests through both routers at once complete
    with the offline text (prompts already served: the workers' caches keep this one short)."""
    second, hosts = cluster.second, cluster.hosts
    assert {w: v["role"] for w, v in second.workers().items()} == {"p0": "prefill", "d0": "decode"}
    assert_kv_crossed(second, offline, notes(6), hosts["prefill"], hosts["decode"])
    prompts = {cluster: notes(6), second: PROMPTS[0]}  # each router the other's (cached)
    expected = {router: offline.text(p) for router, p in prompts.items()}
    got: dict = {}
    both = [threading.Thread(target=lambda r=r: got.setdefault(r, r.text(prompts[r])))
            for r in prompts]  # fmt: skip
    for thread in both:
        thread.start()
    for thread in both:
        thread.join()
    assert got == expected
    cluster.wait_clean()
    second.wait_clean()


def test_the_kv_store_on_its_own_host_receives_the_finished_blocks(cluster, offline):
    per_token = offline.per_token
    store = cluster.hosts["store"]
    received = store.bytes_received()
    prompt = PROMPTS[1]
    assert cluster.complete(body(prompt))["choices"][0]["text"] == offline.text(prompt)
    known = wait_until(
        lambda: cluster.get("/health").json().get("kv_store_blocks_known", 0),
        30,
        "the router to hear of blocks in the KV store",
    )
    assert known > 0
    assert store.bytes_received() - received >= 16 * per_token  # at least one block's bytes


def test_a_router_refuses_a_non_loopback_control_socket_without_the_secret(cluster):
    host = cluster.hosts["client"]  # a host with an address of its own, nothing running on it
    done = subprocess.run(
        [*host.prefix(), sys.executable, "-m", "pdserve.cli", "router", "--port", "0",
         "--control-host", host.address],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items()
             if not k.startswith("PDSERVE_SECRET")},
    )  # fmt: skip
    assert done.returncode != 0
    assert "PDSERVE_SECRET" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def _stream(cluster, prompt: str, seen: list, started: threading.Event) -> None:
    """A long greedy stream on the client host: each data event into `seen`."""

    def run():
        request = body(prompt, max_tokens=4000, stream=True)
        with httpx.stream("POST", URL + "/v1/completions", json=request, timeout=60) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    seen.append(line[6:])
                    started.set()

    try:
        cluster.call(run)
    except httpx.HTTPError as exc:  # the connection dropped: what the client sees, recorded
        seen.append(f"(connection error: {exc!r})")
    finally:
        started.set()


def test_a_partition_of_the_decode_host_mid_stream_ends_it_clearly_and_leaks_nothing(
    cluster, offline
):
    seen: list[str] = []
    started = threading.Event()
    client = threading.Thread(target=_stream, args=(cluster, notes(4), seen, started))
    client.start()
    assert started.wait(60), "the stream never started"
    decode = cluster.hosts["decode"]
    decode.partition()
    try:
        client.join(30)  # the router declares d0 dead after --heartbeat-timeout-s 3
        assert not client.is_alive(), f"the stream hung after the partition: {seen[-3:]}"
        errors = [e for e in seen if "error" in e]
        print("partition: the stream ended with", seen[-2:])
        assert errors, f"the stream ended without saying why: {seen[-3:]}"
        assert "[DONE]" not in seen[-1] or errors
    finally:
        decode.heal()
    # d0 heard nothing from the router for --router-timeout-s: it dropped the stream and freed
    # its blocks, and registers again once the router answers.
    worker = cluster.procs["decode"]
    wait_until(
        lambda: any("freed their blocks" in x or "reset this worker" in x for x in worker.lines),
        30,
        "the decode worker to drop the partitioned stream",
        state=lambda: worker.lines[-5:],
    )
    cluster.wait_clean(60)
    assert cluster.metric("pdserve_worker_failures_total") >= 1
    # registered again and staying so for longer than --heartbeat-timeout-s (one run in three
    # saw the first request after the heal fail with 503 when it was sent at once: see the
    # report; this waits that window out, and the print below says what the workers logged)
    failures = cluster.metric("pdserve_worker_failures_total")
    steady_since = [time.monotonic()]

    def steady() -> bool:
        if cluster.metric("pdserve_worker_failures_total") != failures:
            raise AssertionError("the router declared a worker dead again after the heal")
        cluster.wait_clean(30)
        return time.monotonic() - steady_since[0] > 4

    wait_until(steady, 60, "the workers steady for 4 s after the heal")
    prompt = PROMPTS[0]
    try:
        assert cluster.complete(body(prompt))["choices"][0]["text"] == offline.text(prompt)
    except AssertionError:
        for name in ("router", "prefill", "decode"):
            print(f"--- {name}:", "".join(cluster.procs[name].lines[-15:]))
        raise
    cluster.wait_clean()


def complete_shaped(cluster, prompt: str, **shape) -> tuple[dict, float]:
    """One completion while the prefill host's link is shaped so: its reply and seconds."""
    prefill = cluster.hosts["prefill"]
    prefill.shape(**shape)
    try:
        start = time.monotonic()
        reply = cluster.complete(body(prompt))
        return reply, time.monotonic() - start
    finally:
        prefill.unshape()


def test_a_link_cut_to_10_mbit_gives_up_the_push_and_the_decode_worker_prefills(cluster, offline):
    """--transfer-timeout-s after the prompt was computed the prefill worker gives up a push its
    decode worker has not acknowledged; the decode worker then prefills it (docs/serving.md)."""
    per_token = offline.per_token
    prompt = PROMPTS[2]
    failures = cluster.metric("pdserve_kv_transfer_failures_total")
    reply, took = complete_shaped(cluster, prompt, rate_bit=10e6)
    assert reply["choices"][0]["text"] == offline.text(prompt)
    wire_s = reply["usage"]["prompt_tokens"] * per_token * 8 / 10e6
    assert wire_s > 3 * TRANSFER_TIMEOUT_S  # the link really is too slow for this push
    assert took < wire_s, (took, wire_s)  # it did not wait for the push
    assert cluster.metric("pdserve_kv_transfer_failures_total") == failures + 1
    cluster.wait_clean()


def test_50_ms_and_5_percent_loss_on_the_prefill_link_slow_the_push_and_lose_nothing(
    cluster, offline
):
    """The prefill host's link delays every frame 50 ms each way and drops 5 % of them
    (bench/wire.py): the request completes with the offline text, its push either lands (and
    took at least the round trip its acknowledgement needs) or is given up after
    --transfer-timeout-s and prefilled on the decode worker; nothing is left held."""
    per_token = offline.per_token
    prompt = PROMPTS[3]  # its own: no cached prefix shortens the push
    names = ("pdserve_kv_transfer_seconds_total", "pdserve_kv_transfer_bytes_total",
             "pdserve_kv_transfer_failures_total")  # fmt: skip
    before = [cluster.metric(x) for x in names]
    reply, took = complete_shaped(cluster, prompt, delay_ms=50, loss_pct=5, seed=7)
    assert reply["choices"][0]["text"] == offline.text(prompt)
    push_s, pushed, failed = (cluster.metric(x) - b for x, b in zip(names, before, strict=True))
    print(f"50 ms + 5 % loss: request {took:.2f} s, push {push_s:.2f} s for {pushed / 1e6:.1f} "
          f"MB, {failed:g} given up")  # fmt: skip
    assert took >= 0.1  # the router's message to the prefill host and the KV crossed its link
    if failed:
        assert failed == 1 and took >= TRANSFER_TIMEOUT_S
    else:
        assert pushed >= reply["usage"]["prompt_tokens"] * per_token
        assert push_s >= 0.1  # its acknowledgement came back over the delayed link
    cluster.wait_clean()
