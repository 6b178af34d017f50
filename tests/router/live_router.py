"""The real router HTTP app (FastAPI on uvicorn, in a thread of the test process) over a
RouterCore whose workers are fakes: its control channel records every message the router sends
and plays a decode worker's part of the handoff (an `Admit` with remote prefill is answered with
a `Placement`, so the router sends `Prefill` to the prefill worker) and never produces a token,
so a request waits for its first token until the client leaves."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn

from pdserve.model.loader import load_tokenizer
from pdserve.protocol import messages as m
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.frontend import Frontend

from .conftest import load, worker


class FakeWorkers:
    """A control channel: `sent` holds (worker id, message, monotonic time) of every send."""

    endpoint = "tcp://127.0.0.1:1"

    def __init__(self):
        self.sent: list[tuple[str, object, float]] = []
        self.core: RouterCore | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def send(self, worker_id: str, msg) -> bool:
        self.sent.append((worker_id, msg, time.monotonic()))
        if isinstance(msg, m.Admit) and msg.remote_prefill:
            placed = m.Placement(msg.request_id, [0], 0, ["tcp://127.0.0.1:2"])
            self.loop.call_soon(self.core.handle, worker_id, placed)
        return True

    async def recv(self):
        self.loop = asyncio.get_running_loop()
        await asyncio.Event().wait()  # the fakes send nothing on their own

    def close(self) -> None:
        pass

    def of(self, kind: type, worker_id: str) -> list[tuple[object, float]]:
        return [
            (msg, t) for wid, msg, t in list(self.sent) if wid == worker_id and type(msg) is kind
        ]


def speaking(app, spec_version: str):
    """`app` told that the server speaks ASGI `spec_version`: from 2.4 on, Starlette's
    StreamingResponse no longer listens for http.disconnect itself (it notices a client that
    left only when a write fails), so the app must."""

    async def wrapped(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": spec_version}}
        await app(scope, receive, send)

    return wrapped


class LiveRouter:
    """A router on 127.0.0.1:`port` with decode worker d0 and prefill worker p0 (fakes); every
    prompt is prefilled remotely. `spec_version`: the ASGI version its server claims (None:
    uvicorn's own). A context manager."""

    def __init__(self, spec_version: str | None = None):
        self.workers = FakeWorkers()
        core = RouterCore(
            RouterConfig(local_prefill_threshold=0, heartbeat_timeout_s=3600), channel=self.workers
        )
        self.workers.core = core
        core.workers = {"d0": worker("d0", "decode", load()), "p0": worker("p0", "prefill", load())}
        core.started = True
        self.frontend = Frontend(core, load_tokenizer(None), "tiny")
        app = build_app(self.frontend)
        app = app if spec_version is None else speaking(app, spec_version)
        config = uvicorn.Config(app, host="127.0.0.1", port=0,
                                log_level="warning", lifespan="on")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveRouter:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not (self.server.started and self.workers.loop):
            assert time.monotonic() < deadline, "the router did not start within 30 s"
            time.sleep(0.05)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
