"""Fair admission under overload: who gets the next free slot when more requests arrive than
`--max-inflight` lets run.

Every request belongs to a tenant (its API key from `--api-keys`, else the `X-Tenant` header,
else the `user` field, else "anonymous") and has a priority (vLLM's `priority` extension: lower
first, default 0). Below capacity a request goes straight through. At capacity it waits, at most
`--queue-timeout` seconds and at most `--max-waiting` per tenant (beyond either: 429 with
Retry-After); each slot that frees goes to the waiting request with the lowest priority value,
then to the tenant with the fewest requests in flight (max-min fairness: a tenant that floods
the server cannot starve one that sends a little), then the oldest. Per-key rate limits
(`--api-keys` lines `KEY [REQUESTS_PER_S]`) refuse before anything waits.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.router.admission import Overloaded, retry_after


@dataclass
class Ticket:
    """A request's hold on `weight` slots (its n choices); `Gate.leave` it once."""

    tenant: str
    weight: int
    released: bool = False


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    ticket: Ticket = field(compare=False)
    granted: asyncio.Future = field(compare=False)


class Gate:
    def __init__(self, capacity: int, max_waiting: int = 64, wait_s: float = 30.0):
        self.capacity, self.max_waiting, self.wait_s = capacity, max_waiting, wait_s
        self.used = 0
        self.inflight: Counter[str] = Counter()  # slots held, per tenant
        self.waiting: list[_Waiter] = []
        self._seq = itertools.count()

    async def enter(self, tenant: str, priority: int = 0, weight: int = 1) -> Ticket:
        """A ticket once the request may run; Overloaded if it cannot within the limits."""
        ticket = Ticket(tenant, min(weight, self.capacity))
        if not self.waiting and self.used + ticket.weight <= self.capacity:
            self._take(ticket)
            return ticket
        queued = sum(1 for w in self.waiting if w.ticket.tenant == tenant)
        if queued >= self.max_waiting:
            raise Overloaded(
                f"tenant {tenant!r} already has {queued} requests waiting for capacity "
                "(--max-waiting)",
                reason="tenant_queue",
                retry_after_s=retry_after(self.wait_s / 4),
            )
        waiter = _Waiter(
            priority, next(self._seq), ticket, asyncio.get_running_loop().create_future()
        )
        self.waiting.append(waiter)
        self._dispatch()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self.wait_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.granted.done():  # granted just as it gave up: give the slots back
                self.leave(ticket)
            else:
                self.waiting.remove(waiter)
                waiter.granted.cancel()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Overloaded(
                f"no capacity for {self.wait_s:g} s ({self.used} of {self.capacity} slots in "
                "use; --max-inflight, --queue-timeout)",
                reason="queue_timeout",
                retry_after_s=retry_after(self.wait_s / 4),
            ) from None
        return ticket

    def leave(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.used -= ticket.weight
        self.inflight[ticket.tenant] -= ticket.weight
        if self.inflight[ticket.tenant] <= 0:
            del self.inflight[ticket.tenant]
        self._dispatch()

    def snapshot(self) -> dict:
        """For /health: slots in use of the capacity, and requests waiting, per tenant."""
        waiting = Counter(w.ticket.tenant for w in self.waiting)
        return {"capacity": self.capacity, "in_flight": self.used, "waiting": dict(waiting)}

    def _take(self, ticket: Ticket) -> None:
        self.used += ticket.weight
        self.inflight[ticket.tenant] += ticket.weight

    def _dispatch(self) -> None:
        """Free slots to waiters: lowest priority value, then the tenant with the fewest in
        flight, then the oldest."""
        while self.waiting:
            nxt = min(
                self.waiting, key=lambda w: (w.priority, self.inflight[w.ticket.tenant], w.seq)
            )
            if self.used + nxt.ticket.weight > self.capacity:
                return
            self.waiting.remove(nxt)
            self._take(nxt.ticket)
            nxt.granted.set_result(None)


class RateLimits:
    """Per-API-key token buckets from an `--api-keys` file: `KEY [REQUESTS_PER_S]` per line
    (`#` comments; no rate: unlimited). Burst: one second's worth, at least one request."""

    def __init__(self, rates: dict[str, float | None]):
        self.rates = rates
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill)

    @classmethod
    def from_file(cls, path: str | Path) -> RateLimits:
        rates: dict[str, float | None] = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            parts = line.split("#", 1)[0].split()
            if not parts:
                continue
            try:
                rate = float(parts[1]) if len(parts) > 1 else None
            except ValueError:
                rate = -1.0
            if len(parts) > 2 or (rate is not None and not rate > 0):
                raise ValueError(
                    f"{path}:{n}: expected 'KEY [REQUESTS_PER_S]' with a rate > 0, got {line!r}"
                )
            rates[parts[0]] = rate
        if not rates:
            raise ValueError(f"{path}: no API keys in it (one 'KEY [REQUESTS_PER_S]' per line)")
        return cls(rates)

    def check(self, key: str, now: float | None = None) -> None:
        """Take one request from key's bucket; Overloaded (429) when it is empty."""
        rate = self.rates.get(key)
        if rate is None:
            return
        now = time.monotonic() if now is None else now
        burst = max(1.0, rate)
        tokens, last = self._buckets.get(key, (burst, now))
        tokens = min(burst, tokens + (now - last) * rate)
        if tokens < 1:
            self._buckets[key] = (tokens, now)
            raise Overloaded(
                f"this API key is limited to {rate:g} requests/s",
                reason="rate_limit",
                retry_after_s=max(1, math.ceil((1 - tokens) / rate)),
            )
        self._buckets[key] = (tokens - 1, now)
