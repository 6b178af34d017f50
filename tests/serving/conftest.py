"""Real `pdserve serve` servers (router + worker processes) shared by the serving tests; each is
started by tests/servers.py and stopped when its scope ends."""

from __future__ import annotations

import pytest
from servers import Server


@pytest.fixture(scope="session")
def disagg_server():
    """float32 so that outputs can be compared token for token with the offline engine;
    threshold 0 so that every prompt goes through the prefill pool."""
    with Server(
        "--mode",
        "disagg",
        "--dtype",
        "float32",
        "--local-prefill-threshold",
        "0",
        "--kv-cache-gb",
        "1.0",  # holds the bench test's working set (docs of 2-4k tokens) without preemption
    ) as server:
        yield server


@pytest.fixture(scope="module")
def colocated_server():
    with Server("--mode", "colocated", "--dtype", "float32", "--kv-cache-gb", "0.5") as server:
        yield server
