"""A router that dies (kill -9) mid-stream: its standalone worker, hearing nothing from it for
--router-timeout-s, drops the stream and frees its blocks; a router started again on the same
control address has the worker register again (with its prefix cache's hashes) and serves with
it; the worker never exits."""

from __future__ import annotations

import httpx
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
            next(stream.iter_lines())  # the stream is running on the worker
            router.kill()
        wait_until(
            lambda: any("dropped 1 requests and freed their blocks" in x for x in worker.lines),
            30,
            "the worker to drop the dead router's stream",
            state=lambda: worker.lines[-5:],
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
