"""Graceful drain. SIGTERM of a decode worker with 8 streams in flight: the router places
nothing new on it at once, every stream completes with the greedy text of an undisturbed run,
the worker exits 0 and is not restarted, and no block is left held. SIGTERM of `pdserve serve`
under load: what it admitted finishes, new requests get 503 + Retry-After, exit status 0."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from chaos.cluster import complete
from servers import Server
from waiting import wait_until

pytestmark = pytest.mark.slow
GREEDY = {"max_tokens": 60, "temperature": 0, "ignore_eos": True}
PROMPTS = [f"Story {i}: the lighthouse keeper" for i in range(8)]


def complete_all(url: str, prompts: list[str], out: dict, started: threading.Barrier) -> None:
    def one(p: str) -> None:
        started.wait()
        done = complete(url, {"prompt": p, **GREEDY}, 120)
        out[p] = (done.status, done.text)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    started.wait()
    for t in threads:
        t.join(150)


def test_sigterm_of_a_decode_worker_drains_its_streams():
    with Server(
        "--mode", "disagg", "--decode", "2", "--dtype", "float32", "--kv-cache-gb", "0.25",
    ) as server:  # fmt: skip
        # the undisturbed run, all at once as in the drained one (one by one took 20 s)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            undisturbed = pool.map(lambda p: complete(server.url, {"prompt": p, **GREEDY}, 120),
                                   PROMPTS)  # fmt: skip
            expected = {p: done.text for p, done in zip(PROMPTS, undisturbed, strict=True)}
        out: dict = {}
        started = threading.Barrier(len(PROMPTS) + 1)
        runner = threading.Thread(target=complete_all, args=(server.url, PROMPTS, out, started))
        runner.start()
        busy = wait_until(
            lambda: next(
                (
                    w
                    for w, v in server.health()["workers"].items()
                    if v["role"] == "decode" and v["running"] >= 2
                ),
                None,
            ),  # fmt: skip
            60,
            "streams running on a decode worker",
        )
        pid = server.health()["workers"][busy]["pid"]
        os.kill(pid, signal.SIGTERM)
        wait_until(
            lambda: server.health()["workers"].get(busy, {}).get("draining", True),
            10,
            f"the router to mark {busy} draining",
        )
        runner.join(150)
        assert out == {p: (200, expected[p]) for p in PROMPTS}
        wait_until(lambda: busy not in server.health()["workers"], 30, f"{busy} to leave")
        wait_until(
            lambda: any(f"{busy} drained and exited; not restarted" in x for x in server.lines),
            10,
            f"{busy} to exit 0 and serve not to restart it",
            state=lambda: server.lines[-8:],
        )
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", **GREEDY}, timeout=60)
        assert r.status_code == 200  # the other decode worker serves
        server.wait_idle_and_clean()


def test_sigterm_of_serve_finishes_what_it_admitted_and_exits_0():
    server = Server("--mode", "colocated", "--dtype", "float32", "--kv-cache-gb", "0.25")
    try:
        out: dict = {}
        started = threading.Barrier(len(PROMPTS[:4]) + 1)
        runner = threading.Thread(target=complete_all, args=(server.url, PROMPTS[:4], out, started))
        runner.start()
        wait_until(
            lambda: sum(v["running"] for v in server.health()["workers"].values()) >= 2,
            60,
            "streams running",
        )
        server.proc.send_signal(signal.SIGTERM)
        late = wait_until(
            lambda: (
                r
                if (
                    r := httpx.post(
                        server.url + "/v1/completions", json={"prompt": "Hi", **GREEDY}, timeout=30
                    )
                ).status_code
                == 503
                else None
            ),  # fmt: skip
            10,
            "new requests to be refused",
        )
        assert late.headers["retry-after"] and "shutting down" in late.text
        runner.join(150)
        assert [code for code, _ in out.values()] == [200] * 4
        assert all(text for _, text in out.values())
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
