"""A stub OpenAI-compatible streaming server with known delays and injectable faults.

In tests it runs in a thread (`StubServer`) on a random port. Run as a script it stands in for
`pdserve serve` in `bench compare` tests: it takes `--mode/--chunk-size/--host/--port`, prints a
line with "ready", serves GET /health, and stops on SIGINT or SIGTERM; `--itl-by-mode` sets the
inter-token delay of each mode so the report's verdict is known in advance.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import threading
import time
from dataclasses import dataclass

FAULTS = (None, "http500", "close_early", "disconnect", "malformed", "error_event", "hang")


@dataclass(frozen=True)
class StubConfig:
    """Every request waits `ttft_s` for its first token, then `itl_s` per further token.

    `capacity` requests are served at once, later ones queue (the wait counts into TTFT).
    `fault` hits every `fault_every`-th request (by arrival order, from the first).
    """

    ttft_s: float = 0.05
    itl_s: float = 0.01
    capacity: int | None = None
    fault: str | None = None
    fault_every: int = 1
    send_usage: bool = True


class _Handler:
    """HTTP/1.1 with keep-alive; streams use chunked framing, like real servers."""

    def __init__(self, config: StubConfig) -> None:
        self.config = config
        self.count = 0
        self.received: list[float] = []  # time.perf_counter() at each completion request
        self.slots = asyncio.Semaphore(config.capacity) if config.capacity else None

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            # Cancelled at shutdown: swallowed because 3.11 streams log a cancelled handler.
            pass
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection is to be closed."""
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        fields = dict(h.lower().split(":", 1) for h in head.split("\r\n")[1:] if ":" in h)
        length = int(fields.get("content-length", 0))
        body = json.loads(await reader.readexactly(length)) if length else {}
        if head.startswith("GET "):  # /health, /v1/models: 200 with an empty list
            _reply(writer, "200 OK", b'{"data": []}')
            keep = True
        else:
            keep = await self._complete(body, writer)
        await writer.drain()
        return keep

    async def _complete(self, body: dict, writer: asyncio.StreamWriter) -> bool:
        index, self.count = self.count, self.count + 1
        fault = self.config.fault if index % self.config.fault_every == 0 else None
        if fault == "http500":
            _reply(writer, "500 Internal Server Error", b'{"error": "stub failure"}')
            return True
        if self.slots is None:
            return await self._stream(body, writer, fault)
        async with self.slots:
            return await self._stream(body, writer, fault)

    async def _stream(self, body: dict, writer: asyncio.StreamWriter, fault: str | None) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        tokens, start = int(body.get("max_tokens", 16)), time.perf_counter()
        self.received.append(start)
        if fault == "hang":
            await asyncio.sleep(3600)  # the fault under test: a server that never answers
        for i in range(tokens):
            due = start + self.config.ttft_s + i * self.config.itl_s
            # the stub's latency is what the client measures: pace tokens to the configured
            # TTFT and ITL
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if fault and i == tokens // 2:
                return _fault(writer, fault)
            finish = "length" if i == tokens - 1 else None
            text = {"delta": {"content": " tok"}} if "messages" in body else {"text": " tok"}
            _event(writer, {"choices": [{"index": 0, **text, "finish_reason": finish}]})
            await writer.drain()
        if self.config.send_usage:
            words = len(body.get("prompt", "").split())
            _event(
                writer,
                {"choices": [], "usage": {"prompt_tokens": words, "completion_tokens": tokens}},
            )
        _chunk(writer, b"data: [DONE]\n\n")
        _chunk(writer, b"")  # end of body; the connection stays open
        return True


def _fault(writer: asyncio.StreamWriter, fault: str) -> bool:
    """Misbehave mid-stream; returns whether the connection survives."""
    if fault == "disconnect":
        return False  # drop the connection inside the chunked body
    _chunk(
        writer,
        {
            "close_early": b"",
            "malformed": b"data: {oops\n\n",
            "error_event": b'data: {"error": {"message": "kv lost"}}\n\n',
        }[fault],
    )
    if fault != "close_early":
        _chunk(writer, b"")
    return True


def _reply(writer: asyncio.StreamWriter, status: str, body: bytes) -> None:
    head = f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)


def _chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def _event(writer: asyncio.StreamWriter, obj: dict) -> None:
    _chunk(writer, b"data: " + json.dumps(obj).encode() + b"\n\n")


class StubServer:
    """The stub in a background thread: `with StubServer(config) as url: ...` (url ends in /v1)."""

    def __init__(self, config: StubConfig) -> None:
        self.config = config
        self.handler = _Handler(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        self.server = future.result(timeout=10)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self.handler, "127.0.0.1", 0)

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _shutdown(self) -> None:
        self.server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


async def _serve_forever(config: StubConfig, host: str, port: int) -> None:
    server = await asyncio.start_server(_Handler(config), host, port)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"stub server ready on http://{host}:{port}", flush=True)
    await stop.wait()
    server.close()


def main() -> None:
    """Stand-in for `pdserve serve --mode M [--chunk-size N] --host H --port P`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True)
    parser.add_argument("--chunk-size", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft", type=float, default=0.02)
    parser.add_argument("--itl-by-mode", required=True, help="MODE=SECONDS,...")
    parser.add_argument("--fail-mode", help="exit at once with an error in this mode")
    args = parser.parse_args()
    itl = {k: float(v) for k, v in (kv.split("=") for kv in args.itl_by_mode.split(","))}
    mode = "colocated+chunked" if args.mode == "colocated" and args.chunk_size else args.mode
    if mode == args.fail_mode:
        raise SystemExit(f"stub: mode {mode} is broken on purpose")
    asyncio.run(_serve_forever(StubConfig(args.ttft, itl[mode]), args.host, args.port))


if __name__ == "__main__":
    main()
