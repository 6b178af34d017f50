"""Fixtures for KV store tests: in-process stores served on a free loopback port."""

from __future__ import annotations

import pytest

from pdserve.kv_store.client import StoreClient
from pdserve.kv_store.server import StoreServer
from pdserve.kv_store.store import Store

from .helpers import Served, make_config


@pytest.fixture
def transport() -> str:
    """The store's transport; tests that run over both parametrize it (helpers.both_transports)."""
    return "tcp"


@pytest.fixture
def serve(tmp_path, transport):
    """serve(layout, dram_blocks, ssd_blocks, **server_kw) -> Served; closed after the test,
    then checked for leaks."""
    started: list[Served] = []

    def factory(layout, dram_blocks=64, ssd_blocks=64, config=None, **server_kw) -> Served:
        store = Store(config or make_config(tmp_path / "ssd", layout, dram_blocks, ssd_blocks))
        server = StoreServer(store, **{"transport": transport, **server_kw})
        server.start()
        started.append(Served(store, server))
        return started[-1]

    yield factory
    for s in started:
        s.server.close()
    for s in started:  # after every test: no leaked pin, index and files agree
        s.store.check_integrity()


@pytest.fixture
def client():
    """client(endpoint, layout, k, v, **kw) -> StoreClient; closed after the test."""
    made: list[StoreClient] = []

    def factory(endpoint, layout, k, v, **kw) -> StoreClient:
        made.append(StoreClient(endpoint, layout, k, v, **kw))
        return made[-1]

    yield factory
    for c in made:
        c.close()
