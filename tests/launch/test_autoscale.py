"""`pdserve serve --autoscale` with real worker processes: starting at 1 P + 1 D (at most 2 + 2),
a burst that breaks the TTFT SLO (kept up until the new worker serves) makes the autoscaler
start a worker within two intervals, which registers (`pdserve_workers` rises). Once the load
stops and the cooldown has passed, the pools shrink back by draining. Every request of the run
completes with the greedy text of an undisturbed run. On 2 cores more workers add little
capacity: this checks the mechanism, not the gain (benchmarks/autoscale.py argues the gain with
the simulator)."""

from __future__ import annotations

import re
import threading

import pytest
from servers import Server, live_workers, run_serve, scale_events
from waiting import wait_until

from launch.autoscaling import PROMPTS, at, burst, reference_texts

pytestmark = pytest.mark.slow
INTERVAL_S = 1.0
FLAGS = (
    "--mode", "disagg", "--dtype", "float32", "--kv-cache-gb", "0.25",
    "--autoscale", "--max-prefill", "2", "--max-decode", "2",
    "--slo-ttft", "3.0", "--slo-tpot", "0.25",
    "--scale-interval", str(INTERVAL_S), "--scale-cooldown", "5",
)  # fmt: skip


def test_a_burst_grows_the_pools_and_they_shrink_back_when_it_stops():
    with Server(*FLAGS) as server:
        url = server.url
        # 8 prompts, as the Ray launcher's test sends: their ~2,200 tokens at once break the
        # TTFT SLO as 12 did, and the one-by-one reference run (most of this test) is 2/3 as long
        prompts = PROMPTS[:8]
        expected = reference_texts(url, prompts)
        # the reference run is load too (this machine prefills ~300 tokens/s per core in
        # float32): wait until the pools are back at 1P+1D with nothing starting
        wait_until(lambda: at(server, 1, 1), 60, "1P+1D before the burst",
                   state=lambda: server.health().get("autoscale"))  # fmt: skip
        ups_before = scale_events(url, "up")
        stop = threading.Event()
        threads, out = burst(url, prompts, stop)  # until the new worker serves
        try:
            wait_until(lambda: scale_events(url, "up") > ups_before, 2 * INTERVAL_S + 3.0,
                       "a scale-up within two intervals (+ 3 s for a loaded machine)",
                       state=lambda: server.health().get("autoscale"))  # fmt: skip
            wait_until(lambda: sum(live_workers(url)) > 2, 180,
                       "the new worker to warm up and register",
                       state=lambda: server.health().get("autoscale"))  # fmt: skip
        finally:
            stop.set()
            for t in threads:
                t.join(300)
        assert all(out.values()), "a prompt got no answer"
        assert {p: set(texts) for p, texts in out.items()} == {p: {expected[p]} for p in prompts}
        shrunk = wait_until(lambda: at(server, 1, 1) and scale_events(url, "down"), 90,
                            "the pools to shrink back to 1P+1D after the cooldown",
                            state=lambda: server.health().get("autoscale"))  # fmt: skip
        assert shrunk and server.health()["autoscale"]["decisions"] > 0
        ups = [x for x in server.lines if "autoscale: 1P+1D -> " in x]
        assert ups and re.search(r"arrivals [\d.]+ req/s|observed TTFT p90 [\d.]+ s", ups[-1]), ups
        wait_until(
            lambda: any("drained and exited; not restarted" in x for x in server.lines), 60,
            "the drained worker to exit 0 and not be restarted",
            state=lambda: [x for x in server.lines if "autoscale:" in x or "restart" in x],
        )  # fmt: skip
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
