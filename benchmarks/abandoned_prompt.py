"""TTFT of a long prompt alone, and right after another long prompt whose client left 0.3 s in.

The case of Dynamo #13691: a client that closes its connection before its first token must not
keep the prefill pool busy. Starts `pdserve serve --mode disagg` (the bundled model), then per
round: one 4,311-token prompt alone; then a 4,311-token prompt sent on a raw socket that is
closed 0.3 s later, and at once another, whose TTFT is measured. Every prompt is fresh (no
prefix-cache hits). Prints the medians and their ratio (the target: within ~1.2x).

    .venv/bin/python benchmarks/abandoned_prompt.py [--rounds 3] [--tokens 4311] [--leave-s 0.3]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import median, server, stream_timings  # noqa: E402


def fresh_prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def abandon(url: str, prompt: list[int], leave_s: float) -> None:
    """Send a streamed completion on a raw socket and close it `leave_s` later, unread."""
    host, port = url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + body)
        time.sleep(leave_s)  # the client's own time on the page before it leaves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4311)
    ap.add_argument("--leave-s", type=float, default=0.3)
    args = ap.parse_args()
    rng = random.Random(0)
    alone, after = [], []
    with server("disagg", "--local-prefill-threshold", "0") as url:
        for i in range(args.rounds):
            ttft, _ = stream_timings(url, fresh_prompt(args.tokens, rng), 2)
            alone.append(ttft)
            abandon(url, fresh_prompt(args.tokens, rng), args.leave_s)
            ttft, _ = stream_timings(url, fresh_prompt(args.tokens, rng), 2)
            after.append(ttft)
            print(f"round {i + 1}: alone {alone[-1]:.2f} s, after an abandoned prompt "
                  f"{after[-1]:.2f} s", flush=True)  # fmt: skip
    a, b = median(alone), median(after)
    print(f"TTFT of {args.tokens} tokens: alone {a:.2f} s, after an abandoned prompt {b:.2f} s "
          f"({b / a:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
