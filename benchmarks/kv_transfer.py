"""Layer-wise KV streaming, measured end to end on this machine.

For prompts of 512 and 2048 tokens: prefill alone (co-located TTFT, same single core), the
disaggregated TTFT (prefill on P + push of every layer into D's blocks + first token), the part of
the push that layer-wise streaming did not hide, the transfer bandwidth against this machine's
memcpy and loopback-socket limits, and the TTFT overhead of disaggregation.

    .venv/bin/python benchmarks/kv_transfer.py [--repeats 5] [--lengths 512,2048]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

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


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", default="512,2048")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = {n: prompts(n, args.repeats, n) for n in lengths}
    colo, dis = {}, {}
    # Co-located on one core per worker, like the disaggregated prefill worker.
    with server("colocated", "--colocated-workers", "2", *COMMON) as url:
        for n in lengths:
            colo[n] = median(ttfts(url, batches[n]))
    with server("disagg", "--local-prefill-threshold", "0", *COMMON) as url:
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
            dis[n] = (median(t), d)
    print(
        f"{'prompt':>7} {'prefill alone':>14} {'disagg TTFT':>12} {'P: KV on D':>11} "
        f"{'exposed push':>13} {'MB/req':>7} {'push GB/s':>10} {'memcpy GB/s':>12} "
        f"{'loopback GB/s':>14} {'TTFT overhead':>14}"
    )
    for n in lengths:
        ttft, d = dis[n]
        nbytes = d["pdserve_kv_transfer_bytes_total"]
        mem = nbytes / median(memcpy_seconds(int(nbytes), 5)) / 1e9
        sock = nbytes / median(socket_seconds(int(nbytes), 5)) / 1e9
        push = nbytes / max(d["pdserve_kv_transfer_seconds_total"], 1e-9) / 1e9
        over = (ttft - colo[n]) / colo[n] * 100
        print(
            f"{n:>7} {colo[n] * 1000:>12.0f}ms {ttft * 1000:>10.0f}ms "
            f"{d['pdserve_remote_prefill_seconds_sum'] * 1000:>9.0f}ms "
            f"{d['pdserve_kv_transfer_exposed_seconds_sum'] * 1000:>11.1f}ms {nbytes / 1e6:>7.1f} "
            f"{push:>10.2f} {mem:>12.2f} {sock:>14.2f} {over:>13.1f}%"
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
