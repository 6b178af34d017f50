"""Streaming client for any OpenAI-compatible server, measuring each request.

Only the public OpenAI API is used: ``POST {url}/completions`` (or ``/chat/completions``) with
``stream: true`` and ``stream_options: {"include_usage": true}``. Every server-sent event that
carries output text is one "token event": TTFT is the time to the first, the inter-token
latencies (ITL) are the gaps between consecutive ones, E2E is the time to the end of the stream.
Token counts come from the final `usage` chunk when the server sends one, else from counting
the events.

`send_request` never raises for anything the server does: HTTP errors, a stream that ends
before ``[DONE]`` (or a finish reason), malformed SSE, an error object inside the stream and
connection failures become records with status "error" and a reason; exceeding the per-request
timeout becomes "timeout".
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import msgspec

from pdserve.bench.metrics import RequestRecord, tpot
from pdserve.bench.workload import RequestSpec

APIS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send requests. `url` is the API base, e.g. http://host:port/v1."""

    url: str
    model: str | None = None
    api: str = "completions"
    timeout_s: float = 600.0
    ignore_eos: bool = True  # ours honours it; other servers may ignore or reject it
    api_key: str | None = None
    extra_body: str | None = None  # a JSON object merged into every body (--extra-body)
    temperature: float = 0.0  # 0: greedy (the benchmarks' default); the OpenAI API's is 1
    top_p: float | None = None  # sent only when given

    def __post_init__(self) -> None:
        if self.extra_body is not None:
            try:
                extra = json.loads(self.extra_body)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--extra-body is not valid JSON: {exc}") from None
            if not isinstance(extra, dict):
                raise ValueError("--extra-body must be a JSON object, e.g. '{\"logprobs\": 1}'")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.api not in APIS:
            raise ValueError(f"unknown API {self.api!r}; choose one of {', '.join(APIS)}")
        if not self.timeout_s > 0:
            raise ValueError(f"request timeout must be > 0 seconds, got {self.timeout_s}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def target(self) -> str:
        return self.url.rstrip("/") + APIS[self.api]

    def payload(self, prompt: str, max_tokens: int) -> dict:
        """The JSON body of one streaming request."""
        body: dict = {
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.temperature,
        }
        if self.top_p is not None:
            body["top_p"] = self.top_p
        if self.model:
            body["model"] = self.model
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.extra_body is not None:
            body |= json.loads(self.extra_body)
        return body

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def make_client() -> aiohttp.ClientSession:
    """An HTTP client with no connection cap (a cap would queue requests on our side), no
    proxies from the environment (benchmarks usually target local servers), and room for a
    long SSE line (an event with many logprobs).

    aiohttp, not httpx: the load generator shares the machine with the server it measures,
    and every CPU second it spends is taken from that server. At 64 streams against a 2-core
    server (~700 tokens/s) httpx's stream took ~170 us of CPU a token event; see
    docs/results.md."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
        trust_env=False,
        read_bufsize=1 << 20,
    )


_decode = msgspec.json.Decoder().decode


def _text(data: bytes) -> str:
    return data[:120].decode(errors="replace")


class BadStream(Exception):
    """The server answered, but not with a valid complete stream; the message says how."""


@dataclass
class _Stream:
    """What has been seen of one response so far (times from time.perf_counter)."""

    start: float
    first: float | None = None
    last: float | None = None
    end: float | None = None
    itl: list[float] = field(default_factory=list)
    events: int = 0
    usage: dict | None = None
    finished: bool = False

    def on_line(self, line: bytes, now: float) -> bool:
        """Take one SSE line; True at ``[DONE]``. Raises BadStream on malformed or error data."""
        if not line.startswith(b"data:"):
            return False  # blank separators, comments, event:/id:/retry: fields
        data = line[5:].strip()
        if data == b"[DONE]":
            self.finished = True
            return True
        try:
            obj = _decode(data)
        except msgspec.DecodeError:
            raise BadStream(
                f"malformed SSE data after {self.events} tokens: {_text(data)!r}"
            ) from None
        if not isinstance(obj, dict):
            raise BadStream(f"malformed SSE data (not an object): {_text(data)!r}")
        if "error" in obj:
            raise BadStream(f"error in stream after {self.events} tokens: {obj['error']}")
        self.usage = obj.get("usage") or self.usage
        for choice in obj.get("choices") or []:
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                self._token(now)
            self.finished = self.finished or choice.get("finish_reason") is not None
        return False

    def _token(self, now: float) -> None:
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.events += 1

    def record(self, spec: RequestSpec, t0: float, status: str, error: str | None):
        usage = self.usage or {}
        out = int(usage.get("completion_tokens") or self.events)
        ttft = None if self.first is None else self.first - self.start
        end = time.perf_counter() if self.end is None else self.end  # a failure: time to it
        e2e = end - self.start
        return RequestRecord(
            index=spec.index,
            klass=spec.klass,
            status=status,
            error=error,
            arrival_s=spec.arrival_s,
            start_s=self.start - t0,
            ttft_s=ttft,
            itl_s=self.itl,
            tpot_s=tpot(ttft, e2e, out) if status == "ok" else None,
            e2e_s=e2e,
            prompt_tokens=int(usage.get("prompt_tokens") or spec.prompt_tokens),
            output_tokens=out,
        )


async def _stream(client: aiohttp.ClientSession, endpoint: Endpoint, body: dict, state: _Stream):
    async with client.post(endpoint.target, json=body, headers=endpoint.headers) as response:
        if response.status >= 400:
            text = (await response.read())[:300].decode(errors="replace")
            retry = response.headers.get("retry-after")
            after = f" (Retry-After: {retry})" if retry is not None else ""
            raise BadStream(f"HTTP {response.status}{after}: {text}")
        async for line in response.content:
            if state.on_line(line, time.perf_counter()):
                break
    state.end = time.perf_counter()
    if not state.finished:
        raise BadStream(f"stream closed before [DONE] after {state.events} tokens")
    if state.first is None:
        raise BadStream("stream finished without any output text")


async def send_request(
    client: aiohttp.ClientSession, endpoint: Endpoint, spec: RequestSpec, prompt: str, t0: float
) -> RequestRecord:
    """Send one streaming request and measure it; returns a record whatever happens.

    `t0` is the run's start (time.perf_counter) that `arrival_s`/`start_s` count from.
    """
    state = _Stream(start=time.perf_counter())
    body = endpoint.payload(prompt, spec.output_tokens)
    try:
        async with asyncio.timeout(endpoint.timeout_s):
            await _stream(client, endpoint, body, state)
    except TimeoutError:
        message = f"no complete answer within {endpoint.timeout_s:g} s"
        return state.record(spec, t0, "timeout", message)
    except BadStream as exc:
        return state.record(spec, t0, "error", str(exc))
    except Exception as exc:  # noqa: BLE001 - connection failures, protocol errors, bad bodies
        return state.record(spec, t0, "error", f"{type(exc).__name__}: {exc}")
    return state.record(spec, t0, "ok", None)
