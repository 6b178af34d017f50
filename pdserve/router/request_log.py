"""`--request-log FILE`: one JSON line per finished request, its timeline on the router's clock
(no collector needed). `pdserve bench --request-log FILE` draws its TTFT breakdown from them
(`bench/timeline.py`).

A line::

    {"request_id": "r1a2b3c-7", "status": "ok", "finish_reason": "length",
     "arrival": 1764680000.123,      # Unix time the HTTP request arrived
     "ttft_s": 0.31, "e2e_s": 1.02,  # from arrival, as the client sees them
     "prompt_tokens": 812, "output_tokens": 64,
     "cached_tokens": 256,            # the decode worker's prefix-cache hit (remote prefill)
     "cached_tokens_expected": 256,  # the router's count at placement (its cache index)
     "remote": true, "fallback": false, "migrations": 0,
     "decode_worker": "decode-1", "prefill_worker": "prefill-0",
     "kv_bytes": 1234567, "kv_seconds": 0.012, "kv_exposed_s": 0.002,
     "phases": [["queue", 0.0, 0.001], ["decode_wait", 0.001, 0.004], ...]}

Phases, in order, as [name, start, end] in seconds since arrival, each starting where the one
before ended: queue (a fair turn at --max-inflight), decode_wait (the decode worker finding
blocks for the prompt's KV: remote prefill), prefill_queue (waiting on the prefill worker),
prefill (its forward passes), transfer (the KV push after the last layer: what layer-wise
streaming did not hide), local_prefill (on the decode worker: a local request, or a remote
prefill that failed), decode (first token -> last token). The first token comes at the end of
transfer (remote) or of local_prefill.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec

from pdserve.router.state import RequestState

TTFT_PHASES = ("queue", "decode_wait", "prefill_queue", "prefill", "transfer", "local_prefill")


def phases(state: RequestState) -> list[tuple[str, float, float]]:
    """The request's phases as (name, start, end) on the router's monotonic clock, each
    starting where the one before ended (a worker's durations are clamped into the router's
    span between the messages that bound them)."""
    t0 = state.arrived_at or state.created
    cuts = [("queue", state.created)]
    report, first = state.prefill_report, state.first_token_at
    if state.placed_at is not None and state.prefill_done_at is not None:
        done = state.prefill_done_at
        cuts.append(("decode_wait", state.placed_at))
        cuts.append(("prefill_queue", state.placed_at + report.queue_s))
        cuts.append(("prefill", done - report.exposed_s))
        cuts.append(("transfer", done))
        if report.first_token is None and first is not None:  # P failed: D prefilled it
            cuts.append(("local_prefill", first))
    elif first is not None:
        cuts.append(("local_prefill", first))
    if first is not None and state.last_token_at is not None:
        cuts.append(("decode", state.last_token_at))
    out, start = [], t0
    for i, (name, end) in enumerate(cuts):
        # later cuts bound earlier ones: a worker's duration never crosses a router event
        end = max(start, min([end, *(e for _, e in cuts[i + 1 :] if e is not None)]))
        out.append((name, start, end))
        start = end
    return out


def record(state: RequestState, status: str) -> dict:
    """The JSON line of a finished request (see the module docstring)."""
    now = time.monotonic()
    t0 = state.arrived_at or state.created
    report = state.prefill_report
    return {
        "request_id": state.request_id,
        "status": status,
        "finish_reason": state.finish_reason,
        "arrival": time.time() - (now - t0),
        "ttft_s": None if state.first_token_at is None else state.first_token_at - t0,
        "e2e_s": now - t0,
        "prompt_tokens": len(state.prompt),
        "output_tokens": len(state.tokens),
        "cached_tokens": state.cached_tokens,  # the decode worker's (remote prefill)
        "cached_tokens_expected": len(state.prompt) - state.uncached_tokens,  # at placement
        "remote": state.placed_at is not None,
        "fallback": report is not None and report.first_token is None,
        "migrations": state.migrations,
        "decode_worker": state.decode_id,
        "prefill_worker": state.prefill_id,
        "kv_bytes": report.transfer_bytes if report else 0,
        "kv_seconds": report.transfer_s if report else 0.0,
        "kv_exposed_s": report.exposed_s if report else 0.0,
        "phases": [[name, round(a - t0, 6), round(b - t0, 6)] for name, a, b in phases(state)],
    }


class RequestLog:
    """Appends each finished request's line to `path` (flushed per line: a reader sees every
    request that finished)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.file = open(self.path, "ab")  # noqa: SIM115 (open for the server's life)
        except OSError as exc:
            raise ValueError(f"--request-log {path}: cannot write it ({exc.strerror})") from None
        self._encode = msgspec.json.Encoder().encode

    def write(self, state: RequestState, status: str) -> None:
        self.file.write(self._encode(record(state, status)) + b"\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
