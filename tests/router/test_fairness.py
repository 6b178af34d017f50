"""Fair admission at capacity (router/fairness.py): who gets a freed slot, waiting limits,
timeouts, cancellation, and per-key rate limits."""

import asyncio

import pytest

from pdserve.router.admission import Overloaded
from pdserve.router.fairness import Gate, RateLimits


def run(coro):
    return asyncio.run(coro)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_below_capacity_requests_go_straight_through_and_leave_frees():
    async def main():
        gate = Gate(2)
        a, b = await gate.enter("x"), await gate.enter("y")
        assert gate.used == 2 and gate.inflight == {"x": 1, "y": 1}
        gate.leave(a)
        gate.leave(a)  # twice is once
        gate.leave(b)
        assert gate.used == 0 and not gate.inflight

    run(main())


def test_a_freed_slot_goes_to_the_tenant_with_the_fewest_in_flight_not_the_first_in_line():
    async def main():
        gate = Gate(3)
        heavy = [await gate.enter("heavy") for _ in range(3)]
        order = []

        async def wait(tenant):
            ticket = await gate.enter(tenant)
            order.append(tenant)
            return ticket

        tasks = [asyncio.create_task(wait("heavy")) for _ in range(5)]
        await settle()
        tasks.append(asyncio.create_task(wait("light")))  # arrives last
        await settle()
        gate.leave(heavy[0])
        await settle()
        assert order == ["light"]  # heavy has 2 in flight, light none
        gate.leave(heavy[1])
        await settle()
        assert order == ["light", "heavy"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run(main())


def test_lower_priority_value_goes_first():
    async def main():
        gate = Gate(1)
        first = await gate.enter("a")
        order = []

        async def wait(tenant, priority):
            await gate.enter(tenant, priority)
            order.append(priority)

        tasks = [asyncio.create_task(wait("a", p)) for p in (5, 0, -3)]
        await settle()
        gate.leave(first)
        await settle()
        assert order == [-3]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run(main())


def test_waiting_is_bounded_per_tenant_and_in_time():
    async def main():
        gate = Gate(1, max_waiting=1, wait_s=0.2)
        await gate.enter("a")
        waiter = asyncio.create_task(gate.enter("a"))
        await settle()
        with pytest.raises(Overloaded, match="already has 1 requests waiting") as full:
            await gate.enter("a")
        assert full.value.reason == "tenant_queue"
        with pytest.raises(Overloaded, match="no capacity for 0.2 s") as late:
            await waiter
        assert late.value.reason == "queue_timeout" and not gate.waiting
        assert gate.used == 1  # the timed-out waiter holds nothing

    run(main())


def test_a_cancelled_waiter_holds_nothing_and_a_granted_one_gives_its_slot_back():
    async def main():
        gate = Gate(1)
        first = await gate.enter("a")
        waiter = asyncio.create_task(gate.enter("b"))
        await settle()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert not gate.waiting and gate.used == 1
        gate.leave(first)
        assert gate.used == 0

    run(main())


def test_n_choices_take_n_slots():
    async def main():
        gate = Gate(4)
        t = await gate.enter("a", weight=3)
        assert gate.used == 3
        gate.leave(t)
        big = await gate.enter("a", weight=10)  # more than the whole capacity: all of it
        assert gate.used == 4
        gate.leave(big)

    run(main())


def test_rate_limits_from_a_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\nalpha 2\nbeta\n\n")
    limits = RateLimits.from_file(path)
    assert limits.rates == {"alpha": 2.0, "beta": None}
    limits.check("alpha", now=0.0)
    limits.check("alpha", now=0.0)  # a burst of one second's worth
    with pytest.raises(Overloaded, match="2 requests/s") as exc:
        limits.check("alpha", now=0.1)
    assert exc.value.reason == "rate_limit" and exc.value.retry_after_s == 1
    limits.check("alpha", now=0.6)  # refilled
    for _ in range(100):
        limits.check("beta")  # unlimited
    path.write_text("gamma fast\n")
    with pytest.raises(ValueError, match="KEY \\[REQUESTS_PER_S\\]"):
        RateLimits.from_file(path)
