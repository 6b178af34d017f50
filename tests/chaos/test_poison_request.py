"""One bad request must never take a worker down: the fuzz suite found one that did."""

from __future__ import annotations

import time

import pytest

from .cluster import complete

pytestmark = pytest.mark.slow


def test_refused_remote_admit_does_not_kill_the_decode_worker(cluster):
    cluster.ensure_all()
    pids = cluster.pids()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}
    out = complete(cluster.url, body, timeout_s=30)
    assert (out.kind, out.status) == ("error", 400)
    # What is under test is that nothing happens: no worker exits. There is no event to wait
    # for, so watch for a fixed window; a worker that exits does so within ~1 s.
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        alive = cluster.pids()
        assert alive == pids, f"workers that died: {sorted(set(pids) - set(alive))}"
        time.sleep(0.2)
