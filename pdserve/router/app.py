"""The router's HTTP app: the OpenAI-compatible routes, /health and /metrics over a Frontend."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pdserve.router.frontend import Frontend
from pdserve.router.openai_api.errors import APIError
from pdserve.router.openai_api.schemas import DetokenizeRequest, TokenizeRequest
from pdserve.router.openai_api.validation import parse, read_body

log = logging.getLogger("pdserve.router")


def build_app(frontend: Frontend) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await frontend.core.start()
        yield
        await frontend.core.stop()

    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = {
            404: f"no route {request.url.path}; see /v1/completions, /v1/chat/completions, "
            "/v1/models, /tokenize, /detokenize, /health, /live, /metrics",
            405: f"{request.method} is not allowed on {request.url.path}",
        }
        err = APIError(exc.status_code, message.get(exc.status_code, str(exc.detail)))
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # it left while sending its body: nobody to answer

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(
            APIError(500, f"internal error: {type(exc).__name__}").body(), status_code=500
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await frontend.complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await frontend.complete(request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        frontend.auth.check(request)
        req = parse(await read_body(request), TokenizeRequest)
        frontend.check_model(req.model)
        return frontend.prompts.tokenize(req, frontend.core.max_model_len)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        frontend.auth.check(request)
        req = parse(await read_body(request), DetokenizeRequest)
        frontend.check_model(req.model)
        return frontend.prompts.detokenize(req)

    @app.get("/v1/models")
    async def models(request: Request):
        frontend.auth.check(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": frontend.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "pdserve",
                    "max_model_len": frontend.core.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        """Readiness: 200 once every worker the launcher started has registered and while a
        decode-capable worker is up (`RouterCore.ready`), else 503; each worker's last load
        report (block counts, queues, integrity; `load_age_s`: how old it is) so operators and tests
        see nothing leaked, and `inflight`, the requests the router has placed on it (current,
        unlike the report); the
        workers whose registration was refused, and why (`refused`)."""
        alive, now = frontend.core.alive(), time.monotonic()
        workers = {
            w.worker_id: {
                "role": w.role,
                "pid": w.pid,
                "kv_compression": w.kv_compression,
                "kv_transport": w.kv_transport,
                "draining": w.draining,
                "inflight": len(w.inflight),  # requests the router placed here, now
                **w.placement,
                **(msgspec.structs.asdict(w.load) if w.load else {}),
                **({"load_age_s": round(now - w.load_at, 3)} if w.load else {}),
            }
            for w in alive
        }
        ok = frontend.core.ready
        return JSONResponse(
            {
                "status": "ok" if ok else "starting",
                "workers": workers,
                "kv_store_blocks_known": len(frontend.core.store_index),
                "admission": frontend.gate.snapshot(),
                **({"autoscale": frontend.autoscale} if frontend.autoscale is not None else {}),
                **({"refused": frontend.core.refused} if frontend.core.refused else {}),
            },
            status_code=200 if ok else 503,
        )

    @app.get("/live")
    async def live():
        """Liveness: 200 while the router answers, whatever its workers do."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
