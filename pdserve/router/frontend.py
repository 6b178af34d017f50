"""Frontend: one OpenAI request from body to answer over RouterCore: authentication,
validation and tokenization, submission, the token events turned into text (stop strings),
the whole answer or its SSE stream, and the request metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.engine.guided import GuideSpec
from pdserve.engine.stops import TextStream
from pdserve.model.tokenizer import Tokenizer
from pdserve.router import metrics, tools
from pdserve.router import protocol as p
from pdserve.router.admission import Overloaded
from pdserve.router.core import RouterCore
from pdserve.router.fairness import Gate, RateLimits, Ticket
from pdserve.router.output import Choice, Piece
from pdserve.router.placement import NoWorker
from pdserve.router.plans import Plan, chat_plan, check_token_ids, completion_plan
from pdserve.router.state import RequestState
from pdserve.router.traffic import Traffic

log = logging.getLogger("pdserve.router")


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
        limits: RateLimits | None = None,
        max_waiting: int = 64,
        queue_timeout_s: float = 30.0,
    ):
        self.core, self.tok, self.model_name = core, tokenizer, model_name
        self.api_key, self.request_timeout_s = api_key, request_timeout_s
        self.limits = limits  # --api-keys: the accepted keys and their rate limits
        self.gate = Gate(core.config.max_inflight, max_waiting, queue_timeout_s)
        self.draining = False  # SIGTERM of serve: refuse new requests, finish admitted ones
        self.traffic = Traffic()  # arrivals and latencies, for the autoscaler
        self.autoscale: dict | None = None  # the autoscaler's last decision (GET /health)
        self.eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        # a token's text in logprobs (special tokens shown)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda t: tokenizer.decode([t], skip_special_tokens=False)
        )

    def check_auth(self, request: Request) -> str | None:
        """The request's API key once accepted (None when no key is required)."""
        if self.api_key is None and self.limits is None:
            return None
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        keys = [self.api_key] if self.api_key is not None else []
        keys += list(self.limits.rates) if self.limits is not None else []
        # compare with every key (no early exit), so the time taken does not tell which matched
        if not sum(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
            raise p.APIError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        return given

    @staticmethod
    def tenant_of(request: Request, req, key: str | None) -> str:
        """Who the request counts against for fairness: its API key (never shown: a hash),
        else the X-Tenant header, else the `user` field, else "anonymous"."""
        if key:
            return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]
        return request.headers.get("x-tenant") or req.user or "anonymous"

    async def admit(self, request: Request, req, key: str | None, weight: int) -> Ticket:
        """Rate limit of the key, then a fair turn at capacity (router/fairness.py)."""
        if self.draining:
            metrics.REJECTED.labels("draining").inc()
            raise p.APIError(
                503, "the server is shutting down and takes no new requests; retry on another "
                "replica", headers={"Retry-After": "5"},
            )  # fmt: skip
        try:
            if self.limits is not None and key:
                self.limits.check(key)
            return await self.gate.enter(self.tenant_of(request, req, key), req.priority, weight)
        except Overloaded as exc:
            raise self.overloaded(exc) from None

    @staticmethod
    def overloaded(exc: Overloaded) -> p.APIError:
        metrics.REJECTED.labels(exc.reason).inc()
        return p.APIError(
            429,
            f"the server is at capacity: {exc}; retry after the indicated delay",
            code="overloaded",
            headers={"Retry-After": str(exc.retry_after_s)},
        )

    def check_model(self, model: str | None) -> None:
        if model not in (None, self.model_name):
            raise p.APIError(
                404,
                f"model {model!r} is not served here; use {self.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def chat_ids(
        self, req, tool_list: list | None, add_generation_prompt: bool = True
    ) -> list[int]:
        """The conversation of a chat or /tokenize request through the chat template."""
        try:
            return self.tok.apply_chat_template(
                p.messages_of(req), add_generation_prompt, tools=tool_list
            )
        except ValueError as exc:
            raise p.APIError(400, str(exc), param="messages") from None

    def prepare(self, req, chat: bool) -> Plan:
        """Validate a parsed request against the model and turn it into a Plan (400s here)."""
        self.check_model(req.model)
        window = self.core.max_model_len
        if window is None:
            raise p.APIError(
                503, "no worker is ready yet; retry shortly", headers={"Retry-After": "1"}
            )
        if not chat:
            return completion_plan(req, self.tok, window)
        ids, tools_on, tool_guide = self.render(req)
        return chat_plan(req, ids, tools_on, tool_guide, self.tok.vocab_size, window)

    def tokenize(self, req: p.TokenizeRequest) -> dict:
        """vLLM's answer shape (`count`, `max_model_len`, `tokens`), which holds llama.cpp's."""
        self.check_model(req.model)
        given = [k for k in ("prompt", "content", "messages") if getattr(req, k) is not None]
        if len(given) != 1:
            raise p.APIError(400, "send exactly one of prompt, content or messages")
        if req.messages is not None:
            listed = tools.tools_for_template(req.tools) if req.tools else None
            ids = self.chat_ids(req, listed, req.add_generation_prompt)
        else:
            ids = self.tok.encode(req.prompt or req.content or "", req.add_special_tokens)
        out = {"count": len(ids), "max_model_len": self.core.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [self.token_text(t) for t in ids]
        return out

    def detokenize(self, req: p.DetokenizeRequest) -> dict:
        """vLLM's `prompt` and llama.cpp's `content`: the same text."""
        self.check_model(req.model)
        check_token_ids(req.tokens, "tokens", self.tok.vocab_size)
        text = self.tok.decode(req.tokens)
        return {"prompt": text, "content": text}

    def render(self, req) -> tuple[list[int], bool, GuideSpec | None]:
        """A chat request's prompt ids, whether its answer may be a tool call, and the
        constraint that forces one (tool_choice required or named)."""
        try:
            tools.check_tools(req.tools, req.tool_choice)
        except tools.ToolError as exc:
            raise p.APIError(400, str(exc), param=exc.param) from None
        choice = req.tool_choice or ("auto" if req.tools else "none")
        use = bool(req.tools) and choice != "none"
        if use and not tools.template_supports_tools(self.tok.chat_template):
            raise p.APIError(
                400,
                "this model's chat template does not support tools; start pdserve with "
                "--chat-template llama3_json_tools (or a template file that renders `tools`)",
                param="tools",
            )
        ids = self.chat_ids(req, tools.tools_for_template(req.tools) if use else None)
        schema = tools.tool_call_schema(req.tools, choice) if use else None
        return ids, use, GuideSpec("json_schema", json.dumps(schema)) if schema else None

    def submit(self, ids, params, near: str | None = None) -> RequestState:
        try:
            return self.core.submit(ids, params, near)
        except Overloaded as exc:
            raise self.overloaded(exc) from None
        except NoWorker:
            metrics.REJECTED.labels("no_worker").inc()
            raise p.APIError(
                503, "no decode worker is available; retry shortly", headers={"Retry-After": "2"}
            ) from None

    async def events(
        self, state: RequestState, stops: tuple[str, ...], request: Request | None = None
    ):
        """Yields a Piece per token; raises APIError on a worker failure or timeout. With
        `request` (non-streaming), a client that hangs up is noticed within a second (the
        caller's `finally` then aborts the request on its workers)."""
        text = TextStream(self.tok, stops, self.eos)
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
            _, token, finish, logprobs = ev
            delta = text.push(token)
            if text.hit:
                yield Piece(delta, "stop", token, logprobs)
                return
            if finish is not None:
                yield Piece(delta + text.flush(), finish, token, logprobs)
                return
            yield Piece(delta, None, token, logprobs)

    async def pieces(self, plan: Plan, states: list, i: int, request: Request | None):
        """Choice i's pieces. Choices after the first are submitted once the first has its
        first token, to its decode worker, where they find the prompt's KV in the prefix
        cache (computed, and with P/D transferred, once); each gets seed + i."""
        if i > 0:
            await states[0].started.wait()
            seed = None if plan.params.seed is None else (plan.params.seed + i) % 2**63
            params = dataclasses.replace(plan.params, seed=seed, prompt_logprobs=None)
            states[i] = self.submit(plan.ids, params, near=states[0].decode_id)
        async for piece in self.events(states[i], plan.params.stop, request):
            yield piece

    async def choices(self, plan: Plan, states: list, request: Request | None):
        """(Choice, Piece) as they come, from all n choices (an echoed prompt first)."""
        out = [
            Choice(i, plan.chat, self.token_text, plan.want_logprobs, plan.tools, plan.keep_output)
            for i in range(plan.n)
        ]
        started = set()
        gens = [self.pieces(plan, states, i, request) for i in range(plan.n)]
        async with aclosing(merge(gens)) as merged:  # closed early: its tasks are cancelled
            async for i, piece in merged:
                if plan.echo is not None and i not in started:
                    out[i].prepend(plan.echo, plan.ids, states[0].prompt_logprobs)
                started.add(i)
                out[i].add(piece)
                yield out[i], piece

    def close(self, states: list, status: str, ticket: Ticket) -> None:
        self.gate.leave(ticket)
        for state in states:
            if state is not None:
                self.core.finish(state, abort=status != "ok" or not state.finished)
                self.record(state, status)

    def usage(self, plan: Plan, states: list) -> dict:
        done = sum(len(s.tokens) for s in states if s is not None) if plan.keep_output else 0
        return p.usage(len(plan.ids), done)

    def record(self, state: RequestState, status: str) -> None:
        metrics.REQUESTS.labels(status).inc()
        ttft = tpot = None
        if state.first_token_at:
            ttft = state.first_token_at - state.created
            metrics.TTFT.observe(ttft)
            metrics.TTFT_BY_CACHE.labels("warm" if state.warm else "cold").observe(ttft)
            n = len(state.tokens)
            if n > 1:
                tpot = (state.last_token_at - state.first_token_at) / (n - 1)
                metrics.ITL.observe(tpot)
        metrics.E2E.observe(time.monotonic() - state.created)
        self.traffic.finished(state.arrival, ttft, tpot, len(state.tokens))

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

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests (503 + Retry-After) and wait up to `timeout_s` for the admitted
        ones to finish (`pdserve serve` on SIGTERM)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        log.warning("draining: %d requests in flight, waiting up to %g s",
                    len(self.core.requests), timeout_s)  # fmt: skip
        while self.core.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        log.warning("drained: %d requests left", len(self.core.requests))

    async def complete(self, request: Request, chat: bool) -> Response:
        key = self.check_auth(request)
        req = p.parse(await self.read_body(request), p.ChatRequest if chat else p.CompletionRequest)
        plan = self.prepare(req, chat)
        arrival = self.traffic.arrived(len(plan.ids), plan.params.max_tokens)
        ticket = await self.admit(request, req, key, plan.n)
        try:
            states: list[RequestState | None] = [self.submit(plan.ids, plan.params)]
        except BaseException:
            self.gate.leave(ticket)
            raise
        states[0].arrival = arrival
        states += [None] * (plan.n - 1)
        rid = p.new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self.stream(request, plan, states, rid, include_usage, ticket),
                media_type="text/event-stream",
            )
        return await self.whole(request, plan, states, rid, ticket)

    async def whole(self, request, plan: Plan, states: list, rid: str, ticket) -> Response:
        status, out = "error", {}
        try:
            async with aclosing(self.choices(plan, states, request)) as choices:
                async for choice, _ in choices:
                    out[choice.index] = choice
            status = "ok"
        except ClientGone:
            status = "cancelled"
            return Response(status_code=499)
        finally:
            self.close(states, status, ticket)
        body = [out[i].whole() for i in sorted(out)]
        return JSONResponse(
            p.completion_body(rid, self.model_name, body, self.usage(plan, states), plan.chat)
        )

    async def stream(self, request, plan, states, rid, include_usage, ticket):
        status = "cancelled"
        try:
            async with aclosing(self.choices(plan, states, None)) as choices:
                async for choice, _ in choices:
                    delta = choice.delta()
                    if delta is not None:
                        yield p.sse(p.chunk_body(rid, self.model_name, [delta], plan.chat))
            if include_usage:
                use = self.usage(plan, states)
                yield p.sse(p.chunk_body(rid, self.model_name, [], plan.chat, use))
            yield p.sse("[DONE]")
            status = "ok"
        except p.APIError as exc:
            status = "error"
            yield p.sse(exc.body())
            yield p.sse("[DONE]")
        finally:  # also runs when the client disconnects (the generator is closed)
            self.close(states, status, ticket)


async def merge(gens: list):
    """(i, item) from several async generators as each yields; the first error ends it."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for item in gen:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, None, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is done:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
