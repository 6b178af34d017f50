"""Layer-wise KV streaming, measured end to end on this machine.

For prompts of 512 and 2048 tokens: prefill alone (co-located TTFT, same single core), the
disaggregated TTFT (prefill on P + push of every layer into D's blocks + first token), the part of
the push that layer-wise streaming did not hide, the transfer bandwidth against this machine's
memcpy and loopback-socket limits, and the TTFT overhead of disaggregation. With
`--kv-compression none,fp8` each wire encoding gets its own disaggregated server (FP8 halves the
bytes of the bf16 cache; it costs a quantize on P and a dequantize on D), and a fixed set of
prompts is answered greedily by each: how many answers FP8 changes, against none.

    .venv/bin/python benchmarks/kv_transfer.py [--repeats 5] [--lengths 512,2048]
        [--kv-compression none,fp8] [--compare-prompts 32]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _servers import median, metric, server, stream_timings  # noqa: E402
from kv_transfer_raw import memcpy_seconds, socket_seconds  # noqa: E402

COMMON = ("--no-prefix-caching", "--dtype", "auto")


def prompts(n_tokens: int, count: int, seed: int) -> list[list[int]]:
    """Distinct random token-id prompts (ids in a safe text range), so nothing is cached."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n_tokens)] for _ in range(count)]


def ttfts(url: str, batch: list[list[int]]) -> list[float]:
    stream_timings(url, batch[0][:64], 2)  # warm up
    return [stream_timings(url, p, 2)[0] for p in batch]


def greedy(url: str, prompts_: list[list[int]], max_tokens: int = 32) -> list[list[int]]:
    """Each prompt's greedy answer, as token ids (logprobs carry them)."""
    out = []
    for p in prompts_:
        body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}  # fmt: skip
        r = httpx.post(url + "/completions", json=body, timeout=300).json()
        out.append(r["choices"][0]["logprobs"]["tokens"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--kv-compression", default="none", help="comma list: none, fp8")
    ap.add_argument(
        "--compare-prompts",
        type=int,
        default=32,
        help="prompts answered greedily by each encoding (with two or more)",
    )
    args = ap.parse_args()
    encodings = args.kv_compression.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = {n: prompts(n, args.repeats, n) for n in lengths}
    colo, dis = {}, {}
    # Co-located on one core per worker, like the disaggregated prefill worker.
    with server("colocated", "--colocated-workers", "2", *COMMON) as url:
        for n in lengths:
            colo[n] = median(ttfts(url, batches[n]))
    fixed = prompts(200, args.compare_prompts, 7)
    answers = {}
    for enc in encodings:
        flags = ("--local-prefill-threshold", "0", "--kv-compression", enc, *COMMON)
        with server("disagg", *flags) as url:
            for n in lengths:
                before = {
                    k: metric(url, k)
                    for k in (
                        "pdserve_kv_transfer_bytes_total",
                        "pdserve_kv_transfer_seconds_total",
                        "pdserve_kv_transfer_exposed_seconds_sum",
                        "pdserve_remote_prefill_seconds_sum",
                    )
                }
                t = ttfts(url, batches[n])
                after = {k: metric(url, k) for k in before}
                d = {k: (after[k] - before[k]) / (args.repeats + 1) for k in before}
                dis[n, enc] = (median(t), d)
            if len(encodings) > 1:
                answers[enc] = greedy(url, fixed)
    print(
        f"{'prompt':>7} {'wire':>5} {'prefill alone':>14} {'disagg TTFT':>12} {'P: KV on D':>11} "
        f"{'exposed push':>13} {'MB/req':>7} {'push GB/s':>10} {'memcpy GB/s':>12} "
        f"{'loopback GB/s':>14} {'TTFT overhead':>14}"
    )
    for n in lengths:
        for enc in encodings:
            ttft, d = dis[n, enc]
            nbytes = d["pdserve_kv_transfer_bytes_total"]
            mem = nbytes / median(memcpy_seconds(int(nbytes), 5)) / 1e9
            sock = nbytes / median(socket_seconds(int(nbytes), 5)) / 1e9
            push = nbytes / max(d["pdserve_kv_transfer_seconds_total"], 1e-9) / 1e9
            over = (ttft - colo[n]) / colo[n] * 100
            print(
                f"{n:>7} {enc:>5} {colo[n] * 1000:>12.0f}ms {ttft * 1000:>10.0f}ms "
                f"{d['pdserve_remote_prefill_seconds_sum'] * 1000:>9.0f}ms "
                f"{d['pdserve_kv_transfer_exposed_seconds_sum'] * 1000:>11.1f}ms "
                f"{nbytes / 1e6:>7.1f} {push:>10.2f} {mem:>12.2f} {sock:>14.2f} {over:>13.1f}%"
            )
    for enc in encodings[1:]:
        ref, got = answers[encodings[0]], answers[enc]
        changed = [i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b]
        first = [next(j for j, (x, y) in enumerate(zip(ref[i], got[i], strict=True)) if x != y)
                 for i in changed]  # fmt: skip
        print(
            f"greedy answers (32 tokens, {len(ref)} prompts of 200 tokens) that {enc} "
            f"changes against {encodings[0]}: {len(changed)}"
            + (f", first differing token at {sorted(first)}" if first else "")
        )
    print(
        "prefill alone = co-located TTFT on one core; P: KV on D = prefill worker from request to "
        "last layer acknowledged; exposed push = wait after the forward pass (not hidden by "
        "layer-wise streaming); push GB/s = bytes / (first layer queued -> last acked), which "
        "overlaps compute. Medians of --repeats requests with distinct prompts, prefix cache off."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
