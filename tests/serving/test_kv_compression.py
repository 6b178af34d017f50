"""`--kv-compression fp8`: the prefill worker pushes FP8 blocks (half the bytes of the bf16
cache), the decode worker dequantizes them into its cache, the request completes; /health says
which encoding each worker uses and the transfer metrics count the bytes by encoding."""

from __future__ import annotations

import re

import httpx
import pytest
from servers import Server

pytestmark = pytest.mark.slow


def test_fp8_on_the_wire_serves_and_is_reported():
    with Server(
        "--mode", "disagg", "--kv-compression", "fp8", "--local-prefill-threshold", "0",
        "--kv-cache-gb", "0.25",
    ) as server:  # fmt: skip
        body = {"prompt": "The capital of France is " * 20, "max_tokens": 8, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        workers = server.health()["workers"]
        assert {w["kv_compression"] for w in workers.values()} == {"fp8"}
        text = httpx.get(server.url + "/metrics", timeout=10).text
        fp8 = re.search(r'^pdserve_kv_transfer_bytes_total\{encoding="fp8"\} (\S+)$', text, re.M)
        assert fp8 and float(fp8[1]) > 0, text[:2000]
        server.wait_idle_and_clean()
