"""Cache-aware disaggregation with the KV store, on a multi-turn workload.

Several chat sessions share a system prompt and grow turn by turn, interleaved. Each decode
worker's own KV cache is kept small (as on a busy server) so that a session's earlier turns are
evicted locally between its turns; with `--kv-store` they are loaded back from the store instead
of recomputed. For every request of the same length we also send a cold prompt (fresh tokens)
so warm and cold TTFT are compared at equal length. Prints TTFT (warm vs cold) and throughput,
store off, `pdserve store` and (with `--mooncake`, needs pdserve[mooncake]) a Mooncake Store
pool started by `--kv-store-backend mooncake`, side by side. With `--hosts` (root, iproute2)
each also runs across network hosts (benchmarks/_kv_hosts.py: the router, the prefill worker,
the decode worker, the store or mooncake_master and the client each on a host of its own, the
same worker cache), printed beside its loopback row: loaded blocks then cross a link.

    .venv/bin/python benchmarks/kv_store.py [--sessions 6 --turns 4] [--mooncake] [--hosts]

`--load` instead measures load throughput per block, both backends side by side (`pdserve
store`; Mooncake staged and zero-copy): on loopback, and with `--hosts` (root, iproute2) also
across network hosts (benchmarks/_kv_load.py).

    .venv/bin/python benchmarks/kv_store.py --load [--blocks 64 --repeats 9] [--hosts]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _servers import median, server, stream_timings  # noqa: E402

WORKER_CACHE = ("--kv-cache-gb", "0.04")  # ~1,700 bf16 tokens of SmolLM2-135M per worker


def run(url: str, args) -> tuple[list[float], list[float], float, int]:
    rng = random.Random(0)
    system = [rng.randrange(1000, 40000) for _ in range(args.system_tokens)]
    sessions = [list(system) for _ in range(args.sessions)]
    warm, cold, tokens, busy = [], [], 0, 0.0
    for turn in range(args.turns):
        for s in sessions:
            s += [rng.randrange(1000, 40000) for _ in range(args.user_tokens)]
            t = time.perf_counter()
            ttft, itl = stream_timings(url, s, args.output_tokens)
            busy += time.perf_counter() - t
            tokens += len(itl) + 1
            s += [rng.randrange(1000, 40000) for _ in range(args.output_tokens)]  # the "answer"
            if turn > 0:
                warm.append(ttft)
                fresh = [rng.randrange(1000, 40000) for _ in range(len(s) - args.output_tokens)]
                cold.append(stream_timings(url, fresh, 2)[0])
    return warm, cold, busy, tokens


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--user-tokens", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--mooncake", action="store_true", help="add a Mooncake Store pool row")
    ap.add_argument("--load", action="store_true", help="load throughput per block instead")
    ap.add_argument("--hosts", action="store_true", help="across network hosts too")
    ap.add_argument("--blocks", type=int, default=64, help="--load: blocks per load call")
    ap.add_argument("--repeats", type=int, default=9, help="--load: calls per way of loading")
    args = ap.parse_args()
    return load_table(args) if args.load else multi_turn_table(args)


LABELS = {None: "store off", "pdserve": "store on", "mooncake": "mooncake"}
SERVE_FLAGS = {None: (), "pdserve": ("--kv-store",),
               "mooncake": ("--kv-store", "--kv-store-backend", "mooncake")}  # fmt: skip


def measure(args, backend: str | None, net=None) -> tuple[list[float], list[float], float, int]:
    """`run` against a deployment with the KV store `backend` (None: off): `pdserve serve` on
    loopback, or on `net`'s hosts (benchmarks/_kv_hosts.py) from its client host."""
    if net is None:
        with server("disagg", *WORKER_CACHE, *SERVE_FLAGS[backend]) as url:
            return run(url, args)
    import _kv_hosts

    with _kv_hosts.deployment(net, backend, WORKER_CACHE) as url:
        return net.hosts["client"].call(run, url, args)


def multi_turn_table(args) -> int:
    backends = [None, "pdserve", *(["mooncake"] if args.mooncake else [])]
    rows = [(LABELS[b], "loopback", *measure(args, b)) for b in backends]
    if args.hosts:
        import _kv_hosts

        with network(_kv_hosts.HOSTS) as net:
            across = [
                (LABELS[b], f"{len(_kv_hosts.HOSTS)} hosts", *measure(args, b, net))
                for b in backends
            ]
        rows = [row for pair in zip(rows, across, strict=True) for row in pair]  # per backend

    def where(text: str) -> str:  # a column of its own with --hosts only
        return f"{text:<9} " if args.hosts else ""

    print(
        f"\n{'':<10} {where('')}{'warm TTFT p50':>14} {'cold TTFT p50':>14} {'warm/cold':>10} "
        f"{'session s':>9} {'tokens/s':>9}"
    )
    for label, place, warm, cold, wall, tokens in rows:
        print(
            f"{label:<10} {where(place)}{median(warm) * 1e3:>12.0f}ms "
            f"{median(cold) * 1e3:>12.0f}ms {median(warm) / median(cold):>10.2f} {wall:>9.1f} "
            f"{tokens / wall:>9.2f}"
        )
    print(
        "warm = turns >= 2 of a session (its history was seen before); cold = fresh tokens of the "
        "same length, sent right after. wall/tokens/s include the cold probes."
    )
    return 0


def network(names: tuple[str, ...]):
    """A netns.Network with a host of each name (root, iproute2); close it (or use `with`)."""
    from pdserve.bench import netns

    net = netns.Network()
    for name in names:
        net.add_host(name)
    return net


def load_table(args) -> int:
    import _kv_load

    places = [("loopback", None)]
    net = network(("pool", "putter", "loader")) if args.hosts else None
    if net:
        places.append(("3 hosts", net.hosts))
    try:
        rows = [(where, *row) for where, hosts in places
                for row in _kv_load.rows(args.blocks, args.repeats, hosts)]  # fmt: skip
    finally:
        if net:
            net.close()
    print(f"\n{args.blocks} blocks of 360 KiB per load call, median of {args.repeats} calls")
    print(f"{'':<9} {'backend':<14} {'load':<10} {'ms/block':>9} {'MB/s':>8}")
    for where, backend, mode, ms, mbs in rows:
        print(f"{where:<9} {backend:<14} {mode:<10} {ms:>9.3f} {mbs:>8.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
