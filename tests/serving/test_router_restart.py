"""A router that dies (kill -9) mid-stream: its standalone worker, hearing nothing from it for
--router-timeout-s, drops the stream and frees its blocks; a router started again on the same
control address has the worker register again (with its prefix cache's hashes) and serves with
it; the worker never exits."""

from __future__ import annotations

import threading

import httpx
from chaos.cluster import Outcome, stream
from servers import Command, free_port, unclean
from waiting import wait_until

ROUTER_READY = r"router on (http://127\.0\.0\.1:\d+)/v1"
BODY = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


def _router(control_port: int) -> Command:
    return Command("router", "--port", "0", "--control-port", str(control_port),
                   "--heartbeat-timeout-s", "2", ready=ROUTER_READY)  # fmt: skip


def _serving(url: str) -> bool:
    return httpx.get(url + "/health", timeout=10).status_code == 200


def test_workers_rejoin_a_restarted_router_which_serves_the_same_tokens():
    port = free_port()
    with _router(port) as router, Command(
        "worker", "--role", "both", "--router", f"tcp://127.0.0.1:{port}", "--worker-id", "w0",
        "--kv-cache-gb", "0.25", "--router-timeout-s", "3", ready=r"worker w0 \(both\) ready",
    ) as worker:  # fmt: skip
        url = router.match[1]
        wait_until(lambda: _serving(url), 60, "the first router to have its worker")
        first = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()
        long = {**BODY, "max_tokens": 5000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=long, timeout=60) as stream:
            # Hold the iterator: a dropped one is closed at once, and closing it closes the
            # connection, so the router would abort the stream itself before it is killed.
            lines = stream.iter_lines()
            next(lines)  # the stream is running on the worker
            router.kill()
        wait_until(
            lambda: any("dropped 1 requests and freed their blocks" in x for x in worker.lines),
            30,
            "the worker to drop the dead router's stream",
            state=lambda: worker.lines[-30:],
        )
        with _router(port) as again:
            url = again.match[1]
            wait_until(lambda: _serving(url), 60, "the worker to register with the new router")
            second = httpx.post(url + "/v1/completions", json=BODY, timeout=60).json()
            assert second["choices"][0]["text"] == first["choices"][0]["text"]
            assert worker.proc.poll() is None
            assert any("router reset this worker" in line for line in worker.lines)
            workers = wait_until(
                lambda: (
                    (w := httpx.get(url + "/health", timeout=10).json()["workers"])
                    and not unclean(w)
                    and w
                ),
                30,
                "the worker idle and clean",
            )
            assert list(workers) == ["w0"]


def test_two_routers_share_a_worker_and_one_dying_costs_only_its_own_streams():
    """Active-active: one worker registered with two routers serves both (the same greedy
    tokens); kill -9 of one router mid-stream ends only that router's stream (the worker drops
    it after --router-timeout-s), while the other router's stream, running on the same worker,
    completes with every token."""
    a_port, b_port = free_port(), free_port()
    with _router(a_port) as a, _router(b_port) as b, Command(
        "worker", "--role", "both", "--router", f"tcp://127.0.0.1:{a_port}",
        "--router", f"tcp://127.0.0.1:{b_port}", "--worker-id", "w0", "--kv-cache-gb", "0.25",
        "--router-timeout-s", "3", ready=r"worker w0 \(both\) ready",
    ) as worker:  # fmt: skip
        a_url, b_url = a.match[1], b.match[1]
        for url in (a_url, b_url):
            wait_until(lambda u=url: _serving(u), 60, f"the worker registered with {url}")
        texts = [
            httpx.post(u + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
            for u in (a_url, b_url)
        ]
        assert texts[0] == texts[1]
        n = 300  # B's stream: under way when A dies
        outs: dict[str, Outcome] = {}

        def run(url: str, max_tokens: int) -> None:
            outs[url] = stream(url, {**BODY, "ignore_eos": True, "max_tokens": max_tokens}, 120)

        # A's stream runs on long after A's death, until the worker drops it
        threads = [threading.Thread(target=run, args=x) for x in ((b_url, n), (a_url, 5000))]
        for t in threads:
            t.start()
        wait_until(
            lambda: (
                httpx.get(b_url + "/health", timeout=10).json()["workers"]["w0"]["running"] == 2
            ),
            30,
            "both streams running on the worker",
        )
        a.kill()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a client hung"
        b_out, a_out = outs[b_url], outs[a_url]
        assert b_out.kind == "ok" and b_out.text, (b_out, worker.lines[-20:])
        assert b_out.completion_tokens == n
        assert a_out.kind in ("error", "unclear")  # its router died: the stream was cut
        wait_until(
            lambda: any("dropped 1 requests and freed their blocks" in x for x in worker.lines),
            30,
            "the worker to drop the dead router's stream (only that one)",
            state=lambda: worker.lines[-5:],
        )
        assert worker.proc.poll() is None
        wait_until(
            lambda: not unclean(httpx.get(b_url + "/health", timeout=10).json()["workers"]),
            30,
            "the worker idle and clean",
        )
