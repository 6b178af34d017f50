"""What the router knows: registered workers (load, cached block hashes) and live requests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingParams


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    layout: object
    kv_endpoint: str | None
    total_blocks: int
    max_model_len: int
    pid: int
    load: m.Load | None = None
    load_at: float = 0.0  # time.monotonic() when `load` arrived
    last_seen: float = field(default_factory=time.monotonic)
    cached: set[int] = field(default_factory=set)  # block hashes this worker holds
    inflight: set[str] = field(default_factory=set)  # request ids placed here
    alive: bool = True
    has_store: bool = False
    placement: dict[str, str] = field(default_factory=dict)  # host; Ray node and actor ids
    kv_compression: str = "none"  # what its KV pushes put on the wire
    kv_transport: str = "tcp"  # how it moves KV (tcp | nixl)
    draining: bool = False  # takes nothing new; what it holds finishes there

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")

    def overlap(self, hashes: list[int]) -> int:
        """Leading blocks of the prompt this worker already caches."""
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n

    def queued_prefill_tokens(self) -> int:
        return self.load.queued_tokens if self.load else 0

    def free_blocks(self) -> int:
        return self.load.free_blocks if self.load else self.total_blocks


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """The next output token for the client (token None: the finish reason alone, for a
    request its last delivered token turned out to end)."""

    token: int | None
    finish: str | None
    logprobs: m.Logprobs | None = None


@dataclass(frozen=True, slots=True)
class ErrorEvent:
    """The request failed (a worker said so, or none can take it): the HTTP status and the
    message for the client."""

    status: int
    message: str


@dataclass(frozen=True, slots=True)
class ClientLeft:
    """The HTTP client disconnected before its answer was ready (router/client_watch.py)."""


RequestEvent = TokenEvent | ErrorEvent | ClientLeft


@dataclass
class RequestState:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    remote: bool
    decode_id: str | None = None
    prefill_id: str | None = None
    events: asyncio.Queue[RequestEvent] = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)  # delivered, in order
    logprobs: list[m.Logprobs | None] = field(default_factory=list)  # per delivered token
    prompt_logprobs: list[m.Logprobs] | None = None  # with the first token, when asked
    started: asyncio.Event = field(default_factory=asyncio.Event)  # first token, or failed
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    migrations: int = 0
    placed_at: float | None = None  # when D reported its blocks (remote prefill)
    warm: bool = False  # most of the prompt was cached (worker or KV store) at placement
    uncached_tokens: int = 0  # prompt tokens someone must compute (admission control)
    arrival: object | None = None  # its `traffic.Arrival` (the first choice's), for the autoscaler
    finish_reason: str | None = None  # as the worker reported it
    # its timeline on the router's clock (router/request_log.py): the HTTP request arrived
    # (before its fair turn), the prefill worker reported, and what it measured
    arrived_at: float | None = None
    prefill_done_at: float | None = None
    prefill_report: m.PrefillDone | None = None  # its timings, bytes; first_token None: failed
    cached_tokens: int | None = None  # the decode worker's prefix-cache hit (Placement)
    span: object | None = None  # its OpenTelemetry request span (pdserve/tracing.py), if traced
    trace: str = ""  # that span's traceparent, handed to its workers in Admit and Prefill
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive tokens

    def deliver(
        self,
        index: int,
        token: int,
        finish_reason: str | None,
        logprobs: m.Logprobs | None = None,
        prompt_logprobs: list[m.Logprobs] | None = None,
    ) -> bool:
        """Queue token `index` for the client unless it is a duplicate (migration replay)."""
        if self.finished:
            return False
        if index == len(self.tokens) - 1 and finish_reason is not None:
            # the last delivered token (e.g. from the prefill worker) ends it
            self.finished, self.finish_reason = True, finish_reason
            self.events.put_nowait(TokenEvent(None, finish_reason))
            return True
        if index != len(self.tokens):
            return False
        now = time.monotonic()
        if self.last_token_at is not None:
            self.gaps.append(now - self.last_token_at)
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self.tokens.append(token)
        self.logprobs.append(logprobs)
        if prompt_logprobs is not None and index == 0:
            self.prompt_logprobs = prompt_logprobs
        self.started.set()
        if finish_reason is not None:
            self.finished, self.finish_reason = True, finish_reason
        self.events.put_nowait(TokenEvent(token, finish_reason, logprobs))
        return True

    def fail(self, status: int, message: str) -> None:
        if not self.finished:
            self.finished = True
            self.started.set()
            self.events.put_nowait(ErrorEvent(status, message))
