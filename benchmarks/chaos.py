"""Chaos run: hundreds of requests against a real `pdserve serve` while workers are killed,
stalled and restarted and KV transfers fail or stall; prints what happened to every request.

    .venv/bin/python benchmarks/chaos.py                 # 500 requests, ~4 minutes on 2 cores
    .venv/bin/python benchmarks/chaos.py --requests 100 --json /tmp/chaos.json

Setup: `pdserve serve --prefill 1 --decode 2`, every prompt through the prefill pool, float32,
heartbeat timeout 2 s, KV lease 4 s. Load: short greedy prompts (known answers, computed before
the chaos starts), 12 clients; 70 % streaming, 20 % non-streaming, 10 % streams the client drops
on purpose. Faults, one after the other in a loop until the load ends:
  kill -9 a decode worker (its streams migrate) -> restart it
  kill -9 the prefill worker (decode workers prefill locally) -> restart it
  SIGSTOP a decode worker until it is declared dead -> SIGCONT: it must rejoin by itself
  a fake prefill worker that drops every KV transfer it is given, for a few seconds
  a fake prefill worker that never answers (the decode worker's lease expires), for a few seconds
Figures: requests sent, completed (and how many with exactly the expected tokens), failed with a
clear error, unclear failures, hung (no answer within --timeout-s), leaked KV blocks after the
run, and completed requests whose tokens differ from the undisturbed run (duplicated or lost
tokens after a migration would show here). Exit status 1 if hung, unclear, leaked or wrong > 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from chaos.cluster import (  # noqa: E402
    Cluster,
    Outcome,
    Server,
    complete,
    metric,
    stream,
    wait_until,
)
from chaos.fakes import FakePrefill, real_layout  # noqa: E402

from pdserve.engine.block_hash import block_hashes  # noqa: E402

HEARTBEAT_S, LEASE_S = 2.0, 4.0
SERVE_ARGS = (
    *("--prefill", "1", "--decode", "2", "--dtype", "float32"),
    *("--local-prefill-threshold", "0", "--heartbeat-timeout-s", str(HEARTBEAT_S)),
    *("--lease-s", str(LEASE_S), "--kv-cache-gb", "0.5"),
    # Unquantized weights: the run compares tokens exactly across batch shapes (a migrated
    # stream's replay is one prefill), and a quantized linear picks its kernel by batch rows.
    *("--weights", "bf16"),
    "--no-restart",  # the run restarts the workers it kills, on its own schedule
)
TOPICS = ["harbour", "orchard", "glacier", "market", "library", "volcano", "railway", "garden"]
PROMPTS = [  # 8 prompts of ~30 tokens: two full KV blocks, so a fake worker can claim them
    f"Write two sentences about the {t}. The {t} is described in the town guide as old, busy "
    f"and well known to every visitor who comes in summer."
    for t in TOPICS
]


@dataclass(frozen=True)
class Config:
    requests: int = 500
    concurrency: int = 12
    max_tokens: int = 10
    fault_every_s: float = 6.0
    timeout_s: float = 120.0
    seed: int = 0
    kv_transport: str = "tcp"

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("--requests, --concurrency and --max-tokens must be >= 1")


def baselines(cluster: Cluster, cfg: Config) -> list[str]:
    """Greedy answers of an undisturbed server, one per prompt."""
    outs = [complete(cluster.url, body(i, cfg)) for i in range(len(PROMPTS))]
    bad = [o for o in outs if o.kind != "ok" or o.completion_tokens != cfg.max_tokens]
    if bad:
        raise RuntimeError(f"the server failed before any fault was injected: {bad[0]}")
    return [o.text for o in outs]


def body(prompt: int, cfg: Config) -> dict:
    return {
        "prompt": PROMPTS[prompt],
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def one_request(url: str, i: int, cfg: Config) -> tuple[int, str, Outcome]:
    """Request i: (prompt index, mode, outcome); mode stream | whole | dropped."""
    rng = random.Random(cfg.seed * 1_000_003 + i)
    prompt, roll = rng.randrange(len(PROMPTS)), rng.random()
    if roll < 0.1:
        return prompt, "dropped", stream(url, body(prompt, cfg), cfg.timeout_s, stop_after=3)
    if roll < 0.3:
        return prompt, "whole", complete(url, body(prompt, cfg), cfg.timeout_s)
    return prompt, "stream", stream(url, body(prompt, cfg), cfg.timeout_s)


# -- faults --------------------------------------------------------------------------------
def token_ids(text: str) -> list[int]:
    """The ids the router computes for a completion prompt (same tokenizer, same call)."""
    from pdserve.model.loader import load_tokenizer

    global _TOKENIZER
    _TOKENIZER = _TOKENIZER or load_tokenizer(None)
    return _TOKENIZER.encode(text)


_TOKENIZER = None


def kill_decode(cluster: Cluster, rng: random.Random) -> str:
    wid = rng.choice([w for w in cluster.argv if w.startswith("decode")])
    cluster.kill(wid)
    cluster.restart(wid)
    return f"kill -9 {wid}, restarted"


def kill_prefill(cluster: Cluster, rng: random.Random) -> str:
    cluster.kill("prefill-0")
    cluster.restart("prefill-0")
    return "kill -9 prefill-0, restarted"


def stall_decode(cluster: Cluster, rng: random.Random) -> str:
    """A worker declared dead while stalled must drop its stale work and rejoin by itself."""
    wid = rng.choice([w for w in cluster.argv if w.startswith("decode")])
    cluster.signal(wid, signal.SIGSTOP)
    cluster.wait_gone(wid)
    cluster.signal(wid, signal.SIGCONT)
    try:
        wait_until(lambda: wid in cluster.health(), 15, f"{wid} to rejoin")
    except AssertionError:
        cluster.restart(wid)
        return f"SIGSTOP {wid} until declared dead, SIGCONT: did NOT rejoin, restarted"
    return f"SIGSTOP {wid} until declared dead, SIGCONT: rejoined"


def fake_prefill(mode: str):
    def fault(cluster: Cluster, rng: random.Random) -> str:
        claimed = rng.sample(range(len(PROMPTS)), 3)
        hashes = [h for i in claimed for h in block_hashes(token_ids(PROMPTS[i]), 16)]
        fake = FakePrefill(
            cluster.control_endpoint, f"fake-{mode}", mode, real_layout(), claim=hashes
        )
        if not fake.register().ok:
            raise RuntimeError("the fake prefill worker was refused")
        time.sleep(LEASE_S + 2)
        fake.close()
        cluster.wait_gone(fake.worker_id)
        return f"fake prefill ({mode}) for prompts {claimed}: {len(fake.prefills)} transfers"

    return fault


FAULTS = [kill_decode, fake_prefill("fail"), kill_prefill, fake_prefill("stall"), stall_decode]


def inject_faults(cluster: Cluster, cfg: Config, stop: threading.Event, log: list) -> None:
    rng = random.Random(cfg.seed)
    for fault in itertools.cycle(FAULTS):
        if stop.wait(cfg.fault_every_s):
            return
        t0 = time.monotonic()
        what = fault(cluster, rng)
        log.append(f"{t0 - START:7.1f}s  {what} ({time.monotonic() - t0:.1f}s)")
        print(log[-1], flush=True)


# -- run and report ------------------------------------------------------------------------
def summarize(results, expected: list[str], cluster: Cluster, cfg: Config) -> dict:
    kinds = Counter(out.kind for _, mode, out in results if mode != "dropped")
    wrong = [
        (p, out)
        for p, mode, out in results
        if out.kind == "ok" and (out.text != expected[p] or out.completion_tokens != cfg.max_tokens)
    ]
    workers = cluster.server.settle(60)  # report what leaked rather than stop
    errors = Counter(out.message for _, _, out in results if out.kind == "error")
    return {
        "requests_sent": len(results),
        "dropped_by_client_on_purpose": sum(mode == "dropped" for _, mode, _ in results),
        "completed": kinds["ok"],
        "completed_with_expected_tokens": kinds["ok"] - len(wrong),
        "failed_with_clear_error": kinds["error"],
        "failed_unclear": kinds["unclear"],
        "hung": kinds["hung"] + sum(o.kind == "hung" for _, m, o in results if m == "dropped"),
        "leaked_blocks": sum(w["total_blocks"] - w["free_blocks"] for w in workers.values()),
        "integrity_errors": [
            w["integrity_error"] for w in workers.values() if w["integrity_error"]
        ],
        "wrong_tokens_in_completed": len(wrong),
        "migrations": metric(cluster.url, "pdserve_migrations_total"),
        "workers_declared_dead": metric(cluster.url, "pdserve_worker_failures_total"),
        "kv_transfer_failures": metric(cluster.url, "pdserve_kv_transfer_failures_total"),
        "error_messages": dict(errors.most_common(5)),
        "first_wrong": [f"prompt {p}: {o.text!r}" for p, o in wrong[:3]],
    }


def run(cfg: Config) -> dict:
    global START
    server = Server(*SERVE_ARGS, "--kv-transport", cfg.kv_transport)
    cluster = Cluster(server, Path(tempfile.mkdtemp(prefix="pdserve-chaos-")))
    try:
        expected = baselines(cluster, cfg)
        stop, log = threading.Event(), []
        START = time.monotonic()
        chaos = threading.Thread(target=inject_faults, args=(cluster, cfg, stop, log))
        chaos.start()
        with ThreadPoolExecutor(cfg.concurrency) as pool:
            results = list(
                pool.map(lambda i: one_request(cluster.url, i, cfg), range(cfg.requests))
            )
        stop.set()
        chaos.join()
        elapsed = time.monotonic() - START
        cluster.ensure_all()
        report = summarize(results, expected, cluster, cfg)
        return {"config": asdict(cfg), "seconds": round(elapsed, 1), "faults": log, **report}
    finally:
        cluster.stop()


START = time.monotonic()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=500, help="requests to send (default 500)")
    ap.add_argument("--concurrency", type=int, default=12, help="concurrent clients (default 12)")
    ap.add_argument("--max-tokens", type=int, default=10, help="tokens per answer (default 10)")
    ap.add_argument("--fault-every-s", type=float, default=6.0, help="pause between faults")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="a request is hung after this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the report here")
    ap.add_argument(
        "--kv-transport", default="tcp", choices=["tcp", "nixl"],
        help="KV transport between the workers: the kills then cut pushes on that path",
    )  # fmt: skip
    args = ap.parse_args(argv)
    cfg = Config(
        args.requests,
        args.concurrency,
        args.max_tokens,
        args.fault_every_s,
        args.timeout_s,
        args.seed,
        args.kv_transport,
    )
    report = run(cfg)
    for key, value in report.items():
        if key not in ("config", "faults"):
            print(f"{key:32s} {value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    bad = report["hung"] + report["failed_unclear"] + report["leaked_blocks"]
    return 1 if bad + report["wrong_tokens_in_completed"] or report["integrity_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
