"""Frontend: one OpenAI request from body to answer over RouterCore: who it is (auth.py), its
body read and checked (openai_api/validation.py) and made into a Plan (openai_api/plans.py),
admission (a fair turn at capacity, rate limits), submission, the answer as its tokens arrive
(answer.py) returned whole or as an SSE stream, a client that leaves noticed at once
(client_watch.py: its request aborted on its workers), the request's metrics; draining."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve import tracing
from pdserve.model.tokenizer import Tokenizer
from pdserve.router import metrics
from pdserve.router.admission import Overloaded
from pdserve.router.answer import Answer
from pdserve.router.auth import Auth
from pdserve.router.client_watch import ClientGone, ClientWatch
from pdserve.router.core import RouterCore
from pdserve.router.fairness import Gate, RateLimits, Ticket
from pdserve.router.openai_api import responses
from pdserve.router.openai_api.errors import APIError
from pdserve.router.openai_api.plans import Plan, chat_plan, completion_plan
from pdserve.router.openai_api.schemas import ChatRequest, CompletionRequest
from pdserve.router.openai_api.validation import parse, read_body
from pdserve.router.placement import NoWorker
from pdserve.router.prompts import Prompts
from pdserve.router.request_log import RequestLog
from pdserve.router.state import RequestState
from pdserve.router.traffic import Traffic

log = logging.getLogger("pdserve.router")


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
        request_log: RequestLog | None = None,
    ):
        self.core, self.model_name, self.request_timeout_s = core, model_name, request_timeout_s
        self.auth = Auth(api_key, limits)
        self.prompts = Prompts(tokenizer)
        self.gate = Gate(core.config.max_inflight, max_waiting, queue_timeout_s)
        self.draining = False  # SIGTERM of serve: refuse new requests, finish admitted ones
        self.traffic = Traffic()  # arrivals and latencies, for the autoscaler
        self.autoscale: dict | None = None  # the autoscaler's last decision (GET /health)
        self.request_log = request_log  # --request-log: a JSON line per finished request

    async def admit(self, request: Request, req, key: str | None, weight: int) -> Ticket:
        """Rate limit of the key, then a fair turn at capacity (router/fairness.py)."""
        if self.draining:
            metrics.REJECTED.labels("draining").inc()
            raise APIError(
                503, "the server is shutting down and takes no new requests; retry on another "
                "replica", headers={"Retry-After": "5"},
            )  # fmt: skip
        try:
            if self.auth.limits is not None and key:
                self.auth.limits.check(key)
            tenant = self.auth.tenant_of(request, req.user, key)
            return await self.gate.enter(tenant, req.priority, weight)
        except Overloaded as exc:
            raise self.overloaded(exc) from None

    @staticmethod
    def overloaded(exc: Overloaded) -> APIError:
        metrics.REJECTED.labels(exc.reason).inc()
        return APIError(
            429,
            f"the server is at capacity: {exc}; retry after the indicated delay",
            code="overloaded",
            headers={"Retry-After": str(exc.retry_after_s)},
        )

    def check_model(self, model: str | None) -> None:
        if model not in (None, self.model_name):
            raise APIError(
                404,
                f"model {model!r} is not served here; use {self.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    def prepare(self, req, chat: bool) -> Plan:
        """Validate a parsed request against the model and turn it into a Plan (400s here)."""
        self.check_model(req.model)
        window = self.core.max_model_len
        if window is None:
            raise APIError(
                503, "no worker is ready yet; retry shortly", headers={"Retry-After": "1"}
            )
        if not chat:
            return completion_plan(req, self.prompts.tok, window)
        ids, tools_on, tool_guide = self.prompts.render(req)
        return chat_plan(req, ids, tools_on, tool_guide, self.prompts.tok.vocab_size, window)

    def submit(self, ids, params, near: str | None = None, span=None) -> RequestState:
        try:
            return self.core.submit(ids, params, near, span)
        except Overloaded as exc:
            raise self.overloaded(exc) from None
        except NoWorker:
            metrics.REJECTED.labels("no_worker").inc()
            raise APIError(
                503, "no decode worker is available; retry shortly", headers={"Retry-After": "2"}
            ) from None

    def close(self, answer: Answer, status: str, ticket: Ticket, watch: ClientWatch) -> None:
        """The answer ended (`status`): its slots back, its requests forgotten (aborted on
        their workers unless they finished), its metrics."""
        watch.stop()
        self.gate.leave(ticket)
        for state in answer.states:
            if state is not None:
                self.core.finish(state, abort=status != "ok" or not state.finished)
                w = self.core.workers.get(state.decode_id or "")
                role = w.role if w is not None else "decode"
                ttft, tpot = metrics.observe_request(state, status, self.model_name, role)
                if self.request_log is not None:
                    self.request_log.write(state, status)
                if state.first_token_at is not None:  # where the trace's TTFT ends
                    tracing.event(state.span, "first_token", state.first_token_at)
                tracing.end(
                    state.span, status=status, request_id=state.request_id,
                    output_tokens=len(state.tokens),
                    ttft_s=ttft, decode_worker=state.decode_id, prefill_worker=state.prefill_id,
                    migrations=state.migrations, finish_reason=state.finish_reason,
                )  # fmt: skip
                self.traffic.finished(state.arrival, ttft, tpot, len(state.tokens))

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
        arrived = time.monotonic()
        key = self.auth.check(request)
        req = parse(await read_body(request), ChatRequest if chat else CompletionRequest)
        plan = self.prepare(req, chat)
        span = None
        if tracing.enabled():  # under the caller's traceparent, if it sent a valid one
            headers = {h: request.headers[h] for h in ("traceparent", "tracestate")
                       if h in request.headers}  # fmt: skip
            span = tracing.start(
                "request", headers, arrived, server=True, model=self.model_name,
                prompt_tokens=len(plan.ids), max_tokens=plan.params.max_tokens, n=plan.n,
                stream=bool(req.stream), endpoint="chat" if chat else "completions",
            )  # fmt: skip
        arrival = self.traffic.arrived(len(plan.ids), plan.params.max_tokens)
        watch = ClientWatch(request)  # from here on, a client that leaves is noticed at once
        ticket = None
        try:
            ticket = await watch.unless_gone(self.admit(request, req, key, plan.n))
            tracing.event(span, "admitted")
            first = self.submit(plan.ids, plan.params, span=span)
        except BaseException as exc:  # nothing was submitted: nothing to abort
            watch.stop()
            tracing.end(span, status="refused", error=type(exc).__name__)
            if ticket is not None:
                self.gate.leave(ticket)
            if isinstance(exc, ClientGone):
                return Response(status_code=499)
            raise
        first.arrival, first.arrived_at = arrival, arrived
        answer = Answer(
            plan, first, self.submit, self.prompts.tok, self.prompts.token_text,
            self.prompts.eos, self.request_timeout_s,
        )  # fmt: skip
        watch.on_leave(answer.client_left)
        rid = responses.new_id("chatcmpl" if chat else "cmpl")
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self.stream(answer, rid, include_usage, ticket, watch),
                media_type="text/event-stream",
            )
        return await self.whole(answer, rid, ticket, watch)

    async def whole(self, answer: Answer, rid: str, ticket: Ticket, watch: ClientWatch):
        status, out = "error", {}
        try:
            async with aclosing(answer.choices()) as choices:
                async for choice, _ in choices:
                    out[choice.index] = choice
            status = "ok"
        except ClientGone:
            status = "cancelled"
            return Response(status_code=499)
        finally:
            self.close(answer, status, ticket, watch)
        body = [out[i].whole() for i in sorted(out)]
        use, chat = answer.usage(), answer.plan.chat
        return JSONResponse(responses.completion_body(rid, self.model_name, body, use, chat))

    async def stream(self, answer: Answer, rid: str, include_usage: bool, ticket, watch):
        status, chat = "cancelled", answer.plan.chat
        try:
            async with aclosing(answer.choices()) as choices:
                async for choice, _ in choices:
                    delta = choice.delta()
                    if delta is not None:
                        body = responses.chunk_body(rid, self.model_name, [delta], chat)
                        yield responses.sse(body)
            if include_usage:
                use = answer.usage()
                yield responses.sse(responses.chunk_body(rid, self.model_name, [], chat, use))
            yield responses.sse("[DONE]")
            status = "ok"
        except ClientGone:
            pass  # nobody to tell: the stream just ends ("cancelled")
        except APIError as exc:
            status = "error"
            yield responses.sse(exc.body())
            yield responses.sse("[DONE]")
        finally:  # also runs when Starlette closes the generator (it saw the client leave)
            self.close(answer, status, ticket, watch)
