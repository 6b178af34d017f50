"""Fair admission under overload against a real `pdserve serve`: a tenant flooding the server
does not starve another; per-key rate limits; keys from --api-keys."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from servers import Server

pytestmark = pytest.mark.slow
BODY = {"prompt": "Count to ten:", "max_tokens": 8, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("heavy-key\nlight-key\nslow-key 0.5\n")
    with Server(
        "--mode", "colocated", "--max-inflight", "2", "--api-keys", str(keys),
        "--max-waiting", "16", "--queue-timeout", "600",
    ) as server:  # fmt: skip
        yield server


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_a_light_tenant_is_served_before_a_flooding_tenant_backlog(server):
    async def main():
        order = []
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

            async def one(key, tag):
                r = await client.post("/v1/completions", json=BODY, headers=auth(key))
                assert r.status_code == 200, r.text
                order.append(tag)

            heavy = [asyncio.create_task(one("heavy-key", f"h{i}")) for i in range(8)]
            for _ in range(3000):  # until the flood is in (60 s at most): 2 running, 6 waiting
                admission = (await client.get("/health")).json()["admission"]
                if sum(admission["waiting"].values()) == 6:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"the flood never queued: {admission}")
            assert admission["in_flight"] == 2
            await one("light-key", "light")
            await asyncio.gather(*heavy)
        return order

    order = asyncio.run(main())
    # first come, first served would put it last; fairly it takes the next free slot (heavy
    # has one in flight then, light none)
    assert len(order) == 9 and order.index("light") <= 3, order
    server.wait_idle_and_clean()


def test_keys_from_the_file_rate_limits_and_wrong_keys(server):
    url = server.url + "/v1/completions"
    one = dict(BODY, max_tokens=1)
    assert httpx.post(url, json=one, headers=auth("nope"), timeout=60).status_code == 401
    assert httpx.post(url, json=one, timeout=60).status_code == 401
    first = httpx.post(url, json=one, headers=auth("slow-key"), timeout=60)
    second = httpx.post(url, json=one, headers=auth("slow-key"), timeout=60)
    assert first.status_code == 200
    assert second.status_code == 429 and int(second.headers["Retry-After"]) >= 1
    assert "limited to 0.5 requests/s" in second.json()["error"]["message"]
    bad = httpx.post(url, json=dict(one, priority=2**40), headers=auth("light-key"), timeout=60)
    assert bad.status_code == 400 and "priority" in bad.json()["error"]["message"]
