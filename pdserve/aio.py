"""The event loop of the processes that move every token over HTTP: the router (one SSE event
a token a stream) and the load generator (`pdserve bench`)."""

from __future__ import annotations

from collections.abc import Callable


def fast_event_loop() -> Callable | None:
    """uvloop's event loop factory where uvloop is installed (a dependency on Linux and macOS),
    else None: asyncio's. On a small machine the router and the load generator take their CPU
    from the workers beside them, and a worker's two threads wait for each other: at 64 streams
    on 2 cores, the router with uvloop and uvicorn's httptools parser (picked up where
    installed) took 3.04 s of CPU where it took 3.3-3.6 s (docs/results.md)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
