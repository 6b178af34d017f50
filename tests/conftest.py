"""Suite-wide: the test process gives its freed memory back to the system after each module.

glibc keeps the heap a module's models and engines used (measured: 5.4 GB held after
tests/engine/test_quant.py and test_real_model.py, 0.5 GB once trimmed), and the whole suite,
with its servers' worker processes beside it, has to fit in this machine's 24 GB: Ray's memory
monitor kills actors above 95 %."""

from __future__ import annotations

import ctypes
import gc

import pytest

try:
    _LIBC = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: nothing to trim
    _LIBC = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the module's fixtures are finalized by now when the next test is in another module
    if _LIBC is not None and (nextitem is None or nextitem.module is not item.module):
        gc.collect()
        _LIBC.malloc_trim(0)
