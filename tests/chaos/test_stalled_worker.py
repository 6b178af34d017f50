"""A decode worker that stalls (SIGSTOP) past the heartbeat timeout is declared dead and its
stream migrates; when it wakes up (SIGCONT) it drops its stale work and rejoins (the router
answers its heartbeat with Reset), instead of lingering as a process the router ignores."""

from __future__ import annotations

import signal

import pytest
from waiting import wait_until

from .cluster import complete, stream
from .conftest import HEARTBEAT_TIMEOUT_S

pytestmark = pytest.mark.slow
GREEDY = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stalled(cluster):
    """Run one stream, SIGSTOP its decode worker after 4 chunks until the router declares it
    dead, then SIGCONT it. Yields (worker id, stream outcome, uninterrupted outcome)."""
    cluster.ensure_all()
    want = complete(cluster.url, GREEDY)
    cluster.wait_decoders_idle()  # its worker's load report must not name the victim
    victim = []

    def on_chunk(n: int) -> None:
        if n == 4:
            victim.append(cluster.busy_decode_worker())
            cluster.signal(victim[0], signal.SIGSTOP)

    try:
        out = stream(cluster.url, GREEDY, on_chunk=on_chunk)
        cluster.wait_gone(victim[0])
    finally:
        if victim:
            cluster.signal(victim[0], signal.SIGCONT)
    return victim[0], out, want


def test_stalled_decode_worker_is_declared_dead_and_its_stream_migrates(cluster, stalled):
    wid, out, want = stalled
    assert (out.kind, out.text, out.completion_tokens) == ("ok", want.text, 32)
    assert out.seconds > HEARTBEAT_TIMEOUT_S  # it waited for the failure detector


def test_stalled_decode_worker_rejoins_after_it_wakes_up(cluster, stalled):
    wid, _, _ = stalled
    wait_until(
        lambda: wid in cluster.health(),
        2.5 * HEARTBEAT_TIMEOUT_S,
        f"{wid} to rejoin after SIGCONT",
        interval_s=0.2,
        state=cluster.health,
    )
    cluster.assert_clean()
