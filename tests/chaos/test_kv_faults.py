"""KV transfer faults, injected by a fake prefill worker that the router prefers for one prompt:
a transfer that never arrives (the decode worker's lease expires and it prefills locally) and
a transfer that fails (the decode worker prefills locally at once). Either way the request
completes with the tokens a healthy prefill pool gives, and no block leaks."""

from __future__ import annotations

import pytest

from pdserve.engine.block_hash import block_hashes

from .cluster import complete, metric
from .conftest import LEASE_S
from .fakes import FakePrefill, real_layout

pytestmark = pytest.mark.slow
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def run_with_fake(cluster, mode: str, prompt: list[int]):
    """One request whose prefill the router hands to a fake worker in `mode`; then the same
    prompt through the real prefill worker, for comparison."""
    cluster.ensure_all()
    fake = FakePrefill(
        cluster.control_endpoint,
        f"fake-{mode}",
        mode,
        real_layout(),
        claim=block_hashes(prompt, 16),  # the real prefill worker has never seen this prompt
    )
    try:
        assert fake.register().ok
        out = complete(cluster.url, {"prompt": prompt, **GREEDY}, timeout_s=60)
    finally:
        fake.close()
    assert [p.prompt for p in fake.prefills] == [prompt]
    cluster.wait_gone(fake.worker_id)
    cluster.assert_clean()
    healthy = complete(cluster.url, {"prompt": prompt, **GREEDY})
    assert (out.kind, out.text, out.completion_tokens) == ("ok", healthy.text, 8), out
    return out


def test_stalled_transfer_expires_lease_and_decode_prefills_locally(cluster):
    out = run_with_fake(cluster, "stall", list(range(1000, 1040)))
    assert LEASE_S <= out.seconds < LEASE_S + 30


def test_failed_transfer_falls_back_to_local_prefill(cluster):
    failures = metric(cluster.url, "pdserve_kv_transfer_failures_total")
    out = run_with_fake(cluster, "fail", list(range(2000, 2040)))
    assert out.seconds < LEASE_S  # no waiting for the lease: the failure is reported at once
    assert metric(cluster.url, "pdserve_kv_transfer_failures_total") == failures + 1
