"""Fixtures for KV transfer tests (factories live in helpers.py)."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer import KVLayout

from .helpers import Pair, make_layout


@pytest.fixture
def make_pair():
    pairs: list[Pair] = []

    def factory(backend: str, layout: KVLayout | None = None, **kw) -> Pair:
        pair = Pair(backend, layout or make_layout(), **kw)
        pairs.append(pair)
        return pair

    yield factory
    for pair in pairs:
        pair.close()
