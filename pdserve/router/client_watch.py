"""ClientWatch: notices a client that closes its connection while its answer is not ready, as
it happens, so its request is aborted on every worker at once (a browser tab closed before the
first token must not keep the prefill pool busy, Dynamo #13691).

Nothing else does it reliably: a non-streamed answer writes nothing until it is complete, and
Starlette's StreamingResponse listens for `http.disconnect` only under servers that speak ASGI
below 2.4 (uvicorn says 2.3 today); from 2.4 on it notices only when a write fails, and a
request waiting for its first token writes nothing. So once the body is read, a task of ours
waits on the request's `receive` for `http.disconnect` (with uvicorn's h11 server, awaiting it
also resumes reading the socket, which is how the closed connection is seen at all).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.requests import Request


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class ClientWatch:
    """Start it once the body has been read (it takes every later ASGI message); `stop()` it
    when the answer ends. `on_leave(fn)`: fn() when the client leaves (at once if it has)."""

    def __init__(self, request: Request):
        self.left = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        self._task = asyncio.create_task(self._watch(request.receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass  # a body is read by now: nothing else is for us
        self.left.set()
        for fn in self._listeners:
            fn()

    def on_leave(self, fn: Callable[[], None]) -> None:
        if self.left.is_set():
            fn()
        else:
            self._listeners.append(fn)

    async def unless_gone(self, aw: Awaitable):
        """What `aw` returns, or ClientGone as soon as the client leaves (`aw` is cancelled:
        e.g. its place in the admission queue is given up)."""
        work = asyncio.ensure_future(aw)
        gone = asyncio.ensure_future(self.left.wait())
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            raise ClientGone
        return work.result()

    def stop(self) -> None:
        self._task.cancel()
