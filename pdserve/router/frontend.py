"""Frontend: one OpenAI request from body to answer over RouterCore: authentication,
validation and tokenization, submission, the token events turned into text (stop strings),
the whole answer or its SSE stream, and the request metrics."""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.model.tokenizer import IncrementalDecoder, Tokenizer
from pdserve.protocol import messages as m
from pdserve.router import metrics
from pdserve.router import protocol as p
from pdserve.router.admission import Overloaded
from pdserve.router.core import RouterCore
from pdserve.router.placement import NoWorker
from pdserve.router.state import RequestState
from pdserve.router.stop import StopChecker


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class Frontend:
    def __init__(
        self,
        core: RouterCore,
        tokenizer: Tokenizer,
        model_name: str,
        api_key: str | None = None,
        request_timeout_s: float = 600.0,
    ):
        self.core, self.tok, self.model_name = core, tokenizer, model_name
        self.api_key, self.request_timeout_s = api_key, request_timeout_s

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise p.APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    def prepare(self, req, chat: bool) -> tuple[list[int], m.Params]:
        if req.model not in (None, self.model_name):
            raise p.APIError(
                404,
                f"model {req.model!r} is not served here; use {self.model_name!r} "
                "(see GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        if chat:
            ids = self.tok.apply_chat_template(p.messages_of(req))
            max_tokens = (
                req.max_completion_tokens
                if req.max_completion_tokens is not None
                else req.max_tokens
            )
        else:
            prompt = p.prompt_of(req)
            ids = self.tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
            max_tokens = req.max_tokens or 16
            if any(t < 0 or t >= self.tok.vocab_size for t in ids):
                raise p.APIError(
                    400, f"prompt token ids must be in [0, {self.tok.vocab_size})", param="prompt"
                )
        window = self.core.max_model_len
        if window is None:
            raise p.APIError(
                503, "no worker is ready yet; retry shortly", headers={"Retry-After": "1"}
            )
        if len(ids) >= window:
            raise p.APIError(
                400,
                f"the prompt has {len(ids)} tokens but the context window is {window}: "
                f"shorten it to at most {window - 1} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        max_tokens = min(max_tokens or window - len(ids), window - len(ids))
        params = m.Params(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )
        return ids, params

    def submit(self, ids, params) -> RequestState:
        try:
            return self.core.submit(ids, params)
        except Overloaded as exc:
            metrics.REJECTED.labels(exc.reason).inc()
            raise p.APIError(
                429,
                f"the server is at capacity: {exc}; retry after the indicated delay",
                code="overloaded",
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from None
        except NoWorker:
            metrics.REJECTED.labels("no_worker").inc()
            raise p.APIError(
                503, "no decode worker is available; retry shortly", headers={"Retry-After": "2"}
            ) from None

    async def events(
        self, state: RequestState, stops: tuple[str, ...], request: Request | None = None
    ):
        """Yields (text_delta, finish_reason|None); raises APIError on a worker failure or
        timeout. With `request` (non-streaming), a client that hangs up is noticed within a
        second (the caller's `finally` then aborts the request on its workers)."""
        dec, stop = IncrementalDecoder(self.tok), StopChecker(stops)
        deadline = time.monotonic() + self.request_timeout_s
        next_check = time.monotonic() + 0.5
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise p.APIError(
                    504, f"the request did not finish within {self.request_timeout_s:.0f}s"
                )
            if request is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + 0.5
                if await request.is_disconnected():
                    raise ClientGone
            try:
                ev = await asyncio.wait_for(state.events.get(), min(left, 0.5))
            except TimeoutError:
                continue
            if ev[0] == "error":  # a 503 (its worker lost, no other) is worth a retry
                retry = {"Retry-After": "2"} if ev[1] == 503 else None
                raise p.APIError(ev[1], ev[2], headers=retry)
            _, token, finish = ev
            text = (
                stop.push(dec.push(token))
                if token is not None and token not in self.core_eos
                else ""
            )
            if stop.hit:
                yield text, "stop"
                return
            if finish is not None:
                yield text + stop.flush(), finish
                return
            yield text, None

    @property
    def core_eos(self) -> set[int]:
        return {self.tok.eos_token_id} if self.tok.eos_token_id is not None else set()

    def record(self, state: RequestState, status: str) -> None:
        metrics.REQUESTS.labels(status).inc()
        if state.first_token_at:
            metrics.TTFT.observe(state.first_token_at - state.created)
            metrics.TTFT_BY_CACHE.labels("warm" if state.warm else "cold").observe(
                state.first_token_at - state.created
            )
            n = len(state.tokens)
            if n > 1:
                metrics.ITL.observe((state.last_token_at - state.first_token_at) / (n - 1))
        metrics.E2E.observe(time.monotonic() - state.created)

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to exceed the limit (a declared
        Content-Length is checked before anything is read)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > p.MAX_BODY_BYTES:
            raise p.APIError(
                413, f"request body of {declared} bytes exceeds the {p.MAX_BODY_BYTES}-byte limit"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > p.MAX_BODY_BYTES:
                raise p.APIError(413, f"request body exceeds the {p.MAX_BODY_BYTES}-byte limit")
            chunks.append(chunk)
        return b"".join(chunks)

    async def complete(self, request: Request, chat: bool) -> Response:
        self.check_auth(request)
        req = p.parse(await self.read_body(request), p.ChatRequest if chat else p.CompletionRequest)
        ids, params = self.prepare(req, chat)
        state = self.submit(ids, params)
        rid = p.new_id("chatcmpl" if chat else "cmpl")
        stops = p.stop_list(req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self.stream(request, state, rid, chat, stops, include_usage),
                media_type="text/event-stream",
            )
        return await self.whole(request, state, rid, chat, stops)

    async def whole(self, request, state, rid, chat, stops) -> Response:
        parts, finish, status = [], None, "error"
        try:
            async for text, reason in self.events(state, stops, request):
                parts.append(text)
                finish = reason
            status = "ok"
        except ClientGone:
            status = "cancelled"
            return Response(status_code=499)
        finally:
            self.core.finish(state, abort=status != "ok" or not state.finished)
            self.record(state, status)
        use = p.usage(len(state.prompt), len(state.tokens))
        return JSONResponse(
            p.completion_body(rid, self.model_name, "".join(parts), finish, use, chat)
        )

    async def stream(self, request, state, rid, chat, stops, include_usage):
        status, first = "cancelled", True
        try:
            async for text, finish in self.events(state, stops):
                if text or finish or first:
                    yield p.sse(p.chunk_body(rid, self.model_name, text, finish, chat, first))
                    first = False
            if include_usage:
                use = p.usage(len(state.prompt), len(state.tokens))
                yield p.sse(p.usage_chunk(rid, self.model_name, use, chat))
            yield p.sse("[DONE]")
            status = "ok"
        except p.APIError as exc:
            status = "error"
            yield p.sse(exc.body())
            yield p.sse("[DONE]")
        finally:  # also runs when the client disconnects (the generator is closed)
            self.core.finish(state, abort=not state.finished or status != "ok")
            self.record(state, status)
