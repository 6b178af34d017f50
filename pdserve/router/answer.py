"""One request's answer as its tokens arrive: its n choices (the later ones submitted beside
the first's KV), each choice's token events turned into text (stop strings), merged as they
come. The frontend makes the whole answer or the SSE stream of it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from contextlib import aclosing

from pdserve.engine.stops import TextStream
from pdserve.model.tokenizer import Tokenizer
from pdserve.router.client_watch import ClientGone
from pdserve.router.openai_api.errors import APIError
from pdserve.router.openai_api.plans import Plan
from pdserve.router.openai_api.responses import usage
from pdserve.router.output import Choice, Piece
from pdserve.router.state import ClientLeft, ErrorEvent, RequestState, TokenEvent


class Answer:
    """`states[0]` is submitted; `submit(ids, params, near)` submits the others. `token_text`:
    a token's text in logprobs; `eos`: tokens that add no text."""

    def __init__(
        self,
        plan: Plan,
        first: RequestState,
        submit: Callable[..., RequestState],
        tokenizer: Tokenizer,
        token_text: Callable[[int], str],
        eos: set[int],
        timeout_s: float,
    ):
        self.plan, self.submit, self.tok = plan, submit, tokenizer
        self.token_text, self.eos, self.timeout_s = token_text, eos, timeout_s
        self.states: list[RequestState | None] = [first] + [None] * (plan.n - 1)
        self.gone = False  # the client left (client_left)

    async def events(self, state: RequestState):
        """Yields a Piece per token; raises APIError on a worker failure or timeout, ClientGone
        once the client has left (`client_left`; the caller's `finally` then aborts the
        request on its workers)."""
        text = TextStream(self.tok, self.plan.params.stop, self.eos)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                if state.events.empty():  # a timer only where it waits: not a token's cost
                    async with asyncio.timeout_at(deadline):
                        ev = await state.events.get()
                elif loop.time() < deadline:
                    ev = state.events.get_nowait()
                else:
                    raise TimeoutError
            except TimeoutError:
                raise APIError(
                    504, f"the request did not finish within {self.timeout_s:.0f}s"
                ) from None
            match ev:
                case ClientLeft():
                    raise ClientGone
                case ErrorEvent(status, message):  # a 503 (its worker lost, no other): retry
                    retry = {"Retry-After": "2"} if status == 503 else None
                    raise APIError(status, message, headers=retry)
                case TokenEvent(token, finish, logprobs):
                    delta = text.push(token)
                    if text.hit:
                        yield Piece(delta, "stop", token, logprobs)
                        return
                    if finish is not None:
                        yield Piece(delta + text.flush(), finish, token, logprobs)
                        return
                    yield Piece(delta, None, token, logprobs)

    def client_left(self) -> None:
        """The client disconnected: every choice's events end (with ClientGone) now, whether
        or not a token is on its way."""
        self.gone = True
        for state in self.states:
            if state is not None:
                state.events.put_nowait(ClientLeft())

    async def pieces(self, i: int):
        """Choice i's pieces. Choices after the first are submitted once the first has its
        first token, to its decode worker, where they find the prompt's KV in the prefix
        cache (computed, and with P/D transferred, once); each gets seed + i."""
        plan, states = self.plan, self.states
        if i > 0:
            await states[0].started.wait()
            seed = None if plan.params.seed is None else (plan.params.seed + i) % 2**63
            params = dataclasses.replace(plan.params, seed=seed, prompt_logprobs=None)
            states[i] = self.submit(plan.ids, params, near=states[0].decode_id)
            if self.gone:
                states[i].events.put_nowait(ClientLeft())
        async for piece in self.events(states[i]):
            yield piece

    async def choices(self):
        """(Choice, Piece) as they come, from all n choices (an echoed prompt first)."""
        plan = self.plan
        shape = dict(
            want_logprobs=plan.want_logprobs, tools=plan.tools, keep_output=plan.keep_output
        )
        out = [
            Choice(i, chat=plan.chat, token_text=self.token_text, **shape) for i in range(plan.n)
        ]
        started = set()
        gens = [self.pieces(i) for i in range(plan.n)]
        async with aclosing(merge(gens)) as merged:  # closed early: its tasks are cancelled
            async for i, piece in merged:
                if plan.echo is not None and i not in started:
                    out[i].prepend(plan.echo, plan.ids, self.states[0].prompt_logprobs)
                started.add(i)
                out[i].add(piece)
                yield out[i], piece

    def usage(self) -> dict:
        live = [s for s in self.states if s is not None]
        done = sum(len(s.tokens) for s in live) if self.plan.keep_output else 0
        return usage(len(self.plan.ids), done)


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
