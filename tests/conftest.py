"""Suite-wide: the test process gives its freed memory back to the system after each module;
fixtures that tests of several packages share (a tiny model's files, the real servers).

glibc keeps the heap a module's models and engines used (measured: 5.4 GB held after
tests/model/test_quant.py and test_real_model.py, 0.5 GB once trimmed), and the whole suite,
with its servers' worker processes beside it, has to fit in this machine's 24 GB: Ray's memory
monitor kills actors above 95 %."""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import pytest
from servers import Server

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


@pytest.fixture(scope="module")
def files():
    """The tiny random model every engine variant is compared on (tests/engine, tests/model)."""
    from factories import make_model_files  # torch and the engine: only for tests that use it

    return make_model_files(seed=1)


# Real `pdserve serve` servers (router + worker processes) shared by the serving and launch tests;
# each is started by tests/servers.py and stopped when its scope ends.


@pytest.fixture(scope="session")
def ext():
    """The C++ extension (csrc/), built or loaded once; skips where it does not build."""
    from pdserve.model import extension

    module = extension.extension_or_none()
    if module is None:
        pytest.skip("the C++ extension does not build here")
    return module


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


_exit_status: int | None = None


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Mooncake's libibverbs (loaded here by tests/kv_store/test_mooncake.py) and NIXL's bundled
    UCX (the in-process nixl tests) crash in their exit-time destructors when one process holds
    both (SIGSEGV after every test has run and been reported; docs/serving.md: a worker does not
    combine them). Once pytest has done everything else, leave with its status, skipping them."""
    if _exit_status is not None and "mooncake.store" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)
