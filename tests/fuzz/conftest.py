"""One `pdserve serve` for the fuzz suite: disaggregated, every prompt through the prefill pool,
and a 64-token context window so that any input the router accepts finishes in seconds."""

from __future__ import annotations

import pytest
from chaos.cluster import Cluster, Server

from .driver import TRIED


@pytest.fixture(scope="session")
def fuzz_server(tmp_path_factory):
    server = Server(
        "--local-prefill-threshold", "0", "--max-model-len", "64", "--kv-cache-gb", "0.25"
    )
    c = Cluster(server, tmp_path_factory.mktemp("fuzz-workers"))
    try:
        yield c
        c.assert_clean(timeout_s=60)  # after all fuzzing: every block of every request freed
    finally:
        c.stop()


def pytest_terminal_summary(terminalreporter):
    if TRIED:
        total = sum(TRIED.values())
        rows = ", ".join(f"{k}: {v}" for k, v in sorted(TRIED.items()))
        terminalreporter.write_line(f"fuzz: {total} inputs sent ({rows})")
