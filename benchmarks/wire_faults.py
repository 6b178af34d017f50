"""KV pushes broken on the wire between real processes, many times per kind and transport:
for each fault (reset mid-layer, frame cut short, garbage frame, a receiver that stops reading;
`PDSERVE_KV_FAULT`, the tcp and nixl connectors' test-only switch) a `pdserve serve --mode
disagg` (float32, every prompt through the prefill pool, --transfer-timeout-s 2) gets requests
until the router has counted `--faults` failed pushes. Every answer is compared with the
offline engine's greedy tokens; at the end every block must be free.

    .venv/bin/python benchmarks/wire_faults.py [--faults 100] [--every 4] [--concurrency 4]
        [--transports tcp,nixl] [--kinds reset,truncate,corrupt,stall]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _servers import metric  # noqa: E402
from servers import Server  # noqa: E402

from pdserve import LLM, SamplingParams  # noqa: E402

PROMPTS = [f"Item {i}: the warehouse in district {i % 7} shipped" for i in range(16)]
MAX_TOKENS = 8


def one(url: str, prompt: str) -> tuple[str, str | None]:
    """(status, text): ok, error (an HTTP error answer) or hung (no answer in 120 s)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    try:
        r = httpx.post(url + "/completions", json=body, timeout=120)
    except httpx.TimeoutException:
        return "hung", None
    return ("ok", r.json()["choices"][0]["text"]) if r.status_code == 200 else ("error", None)


def run_kind(kind: str, transport: str, args, expected: dict[str, str]) -> dict:
    env = {"PDSERVE_KV_FAULT": f"{kind}:{args.every}"}
    counts = {"requests": 0, "ok": 0, "wrong": 0, "error": 0, "hung": 0}
    t0 = time.monotonic()
    flags = ("--mode", "disagg", "--dtype", "float32", "--local-prefill-threshold", "0",
             "--kv-transport", transport, "--transfer-timeout-s", "2")  # fmt: skip
    with Server(*flags, env=env) as server:
        url = server.url + "/v1"
        pool = concurrent.futures.ThreadPoolExecutor(args.concurrency)
        i = 0
        while metric(url, "pdserve_kv_transfer_failures_total") < args.faults:
            batch = [PROMPTS[(i + j) % len(PROMPTS)] for j in range(args.concurrency)]
            i += args.concurrency
            for prompt, (status, text) in zip(
                batch, pool.map(lambda p: one(url, p), batch), strict=True
            ):
                counts["requests"] += 1
                if status == "ok":
                    counts["ok" if text == expected[prompt] else "wrong"] += 1
                else:
                    counts[status] += 1
        counts["faults"] = int(metric(url, "pdserve_kv_transfer_failures_total"))
        workers = server.settle(30)  # report what is left rather than stop
        counts["leaked_blocks"] = sum(
            w["total_blocks"] - w["free_blocks"] for w in workers.values()
        )
        counts["integrity_errors"] = sum(w["integrity_error"] is not None for w in workers.values())
    counts["seconds"] = round(time.monotonic() - t0)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--faults", type=int, default=100, help="failed pushes per kind")
    ap.add_argument("--every", type=int, default=4, help="every N-th layer sent is broken")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kinds", default="reset,truncate,corrupt,stall")
    ap.add_argument("--transports", default="tcp,nixl")
    args = ap.parse_args()
    llm = LLM(dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = {p: llm.generate(p, params)[0].text for p in PROMPTS}
    del llm
    rows = []
    for transport in args.transports.split(","):
        for kind in args.kinds.split(","):
            rows.append((f"{transport} {kind}", run_kind(kind, transport, args, expected)))
            print(*rows[-1], flush=True)
    cols = ["faults", "requests", "ok", "wrong", "error", "hung", "leaked_blocks",
            "integrity_errors", "seconds"]  # fmt: skip
    print("\n| fault | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for kind, c in rows:
        print(f"| {kind} | " + " | ".join(str(c[k]) for k in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
