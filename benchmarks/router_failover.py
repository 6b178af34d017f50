"""A router killed under load, with two routers (active-active) in front of one prefill and one
decode worker (standalone `pdserve worker --router A --router B`): `--streams` streams per
router, kill -9 of router A while they run, then A started again on its control address.

Per round it reports what A's clients saw (an error or a cut stream, never a hang: a stream
silent for 30 s counts as hung), whether B's clients got every token, how long after A's
restart a request through A is answered, and the blocks the workers hold once idle.

    .venv/bin/python benchmarks/router_failover.py [--rounds 3] [--streams 4] [--tokens 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from chaos.cluster import stream  # noqa: E402
from servers import Command, free_port, unclean  # noqa: E402

ROUTER_READY = r"router on (http://127\.0\.0\.1:\d+)/v1"
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def router(control_port: int) -> Command:
    return Command("router", "--port", "0", "--control-port", str(control_port), "--mode",
                   "disagg", "--heartbeat-timeout-s", "2", ready=ROUTER_READY)  # fmt: skip


def worker(role: str, wid: str, cpus: str, ports: list[int]) -> Command:
    routers = [x for p in ports for x in ("--router", f"tcp://127.0.0.1:{p}")]
    return Command("worker", "--role", role, *routers, "--worker-id", wid, "--cpus", cpus,
                   "--kv-cache-gb", "0.5", "--router-timeout-s", "3",
                   ready=rf"worker {wid} \({role}\) ready")  # fmt: skip


def one_stream(url: str, tokens: int, out: dict, started: threading.Event) -> None:
    """One streamed completion: out["outcome"] is complete, error or hung; out["tokens"]."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}
    try:
        done = stream(url, body, 30, on_chunk=lambda _: started.set())
    finally:
        started.set()
    out["outcome"] = {"ok": "complete", "hung": "hung"}.get(done.kind, "error")
    out["tokens"] = done.completion_tokens or 0


def serving(url: str) -> bool:
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                       timeout=5)  # fmt: skip
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def wait(cond, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def one_round(a: Command, b: Command, a_port: int, args) -> tuple[dict, Command]:
    a_url, b_url = a.match[1], b.match[1]
    outs = {"a": [{} for _ in range(args.streams)], "b": [{} for _ in range(args.streams)]}
    threads = []
    for name, url in (("a", a_url), ("b", b_url)):
        for out in outs[name]:
            started = threading.Event()
            t = threading.Thread(target=one_stream, args=(url, args.tokens, out, started))
            t.start()
            started.wait(60)
            threads.append(t)
    a.kill()
    for t in threads:
        t.join(120)
    t0 = time.monotonic()
    a = router(a_port)  # again, on its control address
    wait(lambda: serving(a.match[1]), 60, "router A to serve again")
    back_s = time.monotonic() - t0  # from the new router's start, its own start-up included
    idle_s = wait(
        lambda: not unclean(httpx.get(b_url + "/health", timeout=10).json()["workers"]),
        60,
        "the workers idle and clean",
    )
    workers = httpx.get(b_url + "/health", timeout=10).json()["workers"]
    row = {
        "a_outcomes": sorted(o["outcome"] for o in outs["a"]),
        "b_complete": sum(
            o["outcome"] == "complete" and o["tokens"] == args.tokens for o in outs["b"]
        ),  # fmt: skip
        "hung": sum(o["outcome"] == "hung" for o in outs["a"] + outs["b"]),
        "back_in_service_s": round(back_s, 2),
        "clean_after_s": round(idle_s, 2),
        "held_blocks": sum(w["total_blocks"] - w["free_blocks"] for w in workers.values()),
    }
    return row, a


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4, help="streams per router")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    args = ap.parse_args()
    a_port, b_port = free_port(), free_port()
    rows = []
    a = router(a_port)
    try:
        with (
            router(b_port) as b,
            worker("prefill", "p0", "0", [a_port, b_port]),
            worker("decode", "d0", "1", [a_port, b_port]),
        ):
            for url in (a.match[1], b.match[1]):
                wait(lambda u=url: serving(u), 120, f"{url} to serve")
            for i in range(args.rounds):
                row, a = one_round(a, b, a_port, args)
                rows.append(row)
                print(f"round {i}: {row}", flush=True)
    finally:
        a.stop()
    print(f"\n{args.streams} streams per router x {args.tokens} tokens, kill -9 of router A "
          "mid-stream, A restarted on its control address")  # fmt: skip
    print("| round | A's streams | B's streams complete | hung | A back in service (s) | "
          "workers clean after (s) | blocks held |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        outcomes = ", ".join(f"{n} {k}" for k in sorted(set(r["a_outcomes"]))
                             if (n := r["a_outcomes"].count(k)))  # fmt: skip
        print(
            f"| {i} | {outcomes} | {r['b_complete']}/{args.streams} | {r['hung']} | "
            f"{r['back_in_service_s']} | {r['clean_after_s']} | {r['held_blocks']} |"
        )
    back = statistics.median(r["back_in_service_s"] for r in rows)
    print(f"median time from A's restart to A serving: {back:.2f} s")
    ok = all(
        r["hung"] == 0 and r["b_complete"] == args.streams and r["held_blocks"] == 0 for r in rows
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
