"""`pdserve serve --autoscale` with real worker processes: starting at 1 P + 1 D (at most 2 + 2),
a burst that breaks the TTFT SLO makes the autoscaler start a worker within two intervals,
which registers (`pdserve_workers` rises) and serves; once the load stops and the cooldown has
passed the pools shrink back by draining, and every request of the run completes with the
greedy text of an undisturbed run. On 2 cores more workers add little capacity: this checks the
mechanism, not the gain (benchmarks/autoscale.py argues the gain with the simulator)."""

from __future__ import annotations

import re
import threading
import time

import httpx
import openai
import pytest
from chaos.cluster import complete
from servers import Server, run_serve
from waiting import wait_until

pytestmark = pytest.mark.slow
INTERVAL_S = 1.0
FLAGS = (
    "--mode", "disagg", "--dtype", "float32", "--kv-cache-gb", "0.25",
    "--autoscale", "--max-prefill", "2", "--max-decode", "2",
    "--slo-ttft", "3.0", "--slo-tpot", "0.25",
    "--scale-interval", str(INTERVAL_S), "--scale-cooldown", "5",
)  # fmt: skip
GREEDY = {"max_tokens": 24, "temperature": 0}
PROMPTS = [f"Chapter {i}. " + "The keeper climbed the lighthouse stairs at dusk. " * 30
           for i in range(12)]  # fmt: skip


def samples(url: str, name: str) -> dict[tuple[str, ...], float]:
    """Every sample of one metric: label values (in the order printed) -> value."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            labels = tuple(re.findall(r'="([^"]*)"', line.split("}")[0]))
            out[labels] = float(line.split()[-1])
    return out


def live(url: str) -> tuple[int, int]:
    workers = samples(url, "pdserve_workers")
    return int(workers[("prefill",)]), int(workers[("decode",)])


def scale_events(url: str, direction: str) -> float:
    return sum(v for k, v in samples(url, "pdserve_scale_events_total").items() if direction in k)


def test_a_burst_grows_the_pools_and_they_shrink_back_when_it_stops():
    with Server(*FLAGS) as server:
        url = server.url
        expected = {p: complete(url, {"prompt": p, **GREEDY}, 120).text for p in PROMPTS}
        # the reference run is load too (this machine prefills ~300 tokens/s per core in
        # float32): wait until the pools are back at 1P+1D with nothing starting
        settled = wait_until(
            lambda: live(url) == (1, 1) and server.health()["autoscale"]["target"] == [1, 1]
            and not server.health()["autoscale"]["starting"],
            60, "1P+1D before the burst", state=lambda: server.health().get("autoscale"),
        )  # fmt: skip
        assert settled
        ups_before = scale_events(url, "up")
        # a well-behaved client: the OpenAI client retries a 429 after its Retry-After
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=30, timeout=180)
        model = client.models.list().data[0].id
        out: dict[str, str] = {}

        def one(prompt: str) -> None:
            r = client.completions.create(model=model, prompt=prompt, **GREEDY)
            out[prompt] = r.choices[0].text

        threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        wait_until(lambda: scale_events(url, "up") > ups_before, 2 * INTERVAL_S + 3.0,
                   "a scale-up within two intervals (+ 3 s for a loaded machine)",
                   state=lambda: server.health().get("autoscale"))  # fmt: skip
        decided_s = time.monotonic() - t0
        wait_until(lambda: sum(live(url)) > 2, 120, "the new worker to warm up and register")
        for t in threads:
            t.join(300)
        assert out == expected, "a request's text differs from the undisturbed run"
        shrunk = wait_until(lambda: live(url) == (1, 1) and scale_events(url, "down"), 90,
                            "the pools to shrink back to 1P+1D after the cooldown",
                            state=lambda: server.health().get("autoscale"))  # fmt: skip
        assert shrunk
        status = server.health()["autoscale"]
        assert status["decisions"] > 0 and status["target"] == [1, 1]
        ups = [x for x in server.lines if "autoscale: 1P+1D -> " in x]
        assert ups and re.search(r"arrivals [\d.]+ req/s|observed TTFT p90 [\d.]+ s", ups[-1]), ups
        assert any("drained and exited; not restarted" in x for x in server.lines)
        assert decided_s <= 2 * INTERVAL_S + 3.0
        server.wait_idle_and_clean()


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--autoscale",), "--slo-ttft and --slo-tpot"),
        (("--autoscale", "--mode", "colocated", "--slo-ttft", "1", "--slo-tpot", "1"),
         "needs --mode disagg"),
        (("--max-decode", "2"), "add --autoscale"),
        (("--autoscale", "--slo-ttft", "1", "--slo-tpot", "1", "--decode", "2", "--max-decode",
          "1"), "--max-decode (1) must be >= --decode (2)"),
    ],
)  # fmt: skip
def test_bad_autoscale_flags_are_refused_before_anything_starts(flags, message):
    done = run_serve(*flags)
    assert done.returncode != 0
    assert message in done.stderr + done.stdout
