"""One `pdserve serve` for the fuzz suite: disaggregated, every prompt through the prefill pool,
and a 64-token context window so that any input the router accepts finishes in seconds."""

from __future__ import annotations

import pytest
from chaos.cluster import Cluster
from servers import Server

from .driver import TRIED


@pytest.fixture(scope="package")  # stopped after its tests: the suite must fit in memory
def fuzz_server(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fuzz-workers")
    with (
        Server(
            "--local-prefill-threshold", "0", "--max-model-len", "64", "--kv-cache-gb", "0.25"
        ) as server,
        Cluster(server, log_dir) as c,
    ):
        yield c
        c.assert_clean(timeout_s=60)  # after all fuzzing: every block of every request freed


def pytest_terminal_summary(terminalreporter):
    if TRIED:
        total = sum(TRIED.values())
        rows = ", ".join(f"{k}: {v}" for k, v in sorted(TRIED.items()))
        terminalreporter.write_line(f"fuzz: {total} inputs sent ({rows})")
