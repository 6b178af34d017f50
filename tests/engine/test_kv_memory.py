"""KV cache memory (`engine/kv_memory.py`): zeros that cost nothing until written."""

from __future__ import annotations

import os

import torch

from pdserve.engine.kv_memory import zeroed_caches


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_zeroed_caches_are_zeros_apart_and_backed_only_where_written():
    shape = (2048, 16, 4, 64)  # 16 MiB a tensor in bf16
    before = _rss_bytes()
    caches = zeroed_caches(shape, torch.bfloat16, 64)  # 1 GiB
    assert len(caches) == 64 and all(c.shape == shape for c in caches)
    assert _rss_bytes() - before < 64 << 20  # not written: not backed
    caches[3][7] = 1.5
    caches[4][0] = -2.0
    assert caches[3][7].eq(1.5).all() and caches[4][0].eq(-2.0).all()
    assert int(caches[3].count_nonzero()) == 16 * 4 * 64  # one block of one tensor, no more
    assert int(caches[2].count_nonzero()) == int(caches[5].count_nonzero()) == 0
    assert int(caches[4][1:].count_nonzero()) == 0
    assert _rss_bytes() - before < 128 << 20  # read as zeros without backing them
