"""Where a prompt is prefilled: conditional, cache-aware and pool-load-aware disaggregation."""

from __future__ import annotations

from pdserve.router.placement import prefill_remotely

from .conftest import load, pending, worker


def _cluster(core, **config):
    c = core(local_prefill_threshold=256, **config)
    d = c.workers["d"] = worker("d", "decode", load())
    c.workers["p"] = worker("p", "prefill", load())
    return c, d


def test_long_uncached_prompts_go_to_the_prefill_pool(core):
    c, d = _cluster(core)
    pending(c, "busy", 1000, remote=True, decode_id="d")  # even with the pool busy
    assert prefill_remotely(c.config, c.view(), d, uncached=256, warm=False)


def test_short_cold_prompts_go_to_an_idle_pool_and_stay_on_d_while_it_is_busy(core):
    c, d = _cluster(core)
    assert prefill_remotely(c.config, c.view(), d, uncached=100, warm=False)
    state = pending(c, "r0", 100, remote=True, decode_id="d")
    assert not prefill_remotely(c.config, c.view(), d, uncached=100, warm=False)
    state.tokens.append(1)  # r0's prefill is done: the pool is idle again
    assert prefill_remotely(c.config, c.view(), d, uncached=100, warm=False)


def test_warm_prompts_and_fully_cached_ones_stay_on_d(core):
    c, d = _cluster(core)
    assert not prefill_remotely(
        c.config, c.view(), d, uncached=40, warm=True
    )  # loads its prefix on D
    assert not prefill_remotely(c.config, c.view(), d, uncached=0, warm=False)


def test_keep_short_prefills_local(core):
    c, d = _cluster(core, short_prefills_to_idle_pool=False)
    assert not prefill_remotely(c.config, c.view(), d, uncached=255, warm=False)
    assert prefill_remotely(c.config, c.view(), d, uncached=256, warm=False)


def test_no_prefill_pool_or_colocated_means_local(core):
    c, d = _cluster(core)
    c.workers["p"].alive = False
    assert not prefill_remotely(c.config, c.view(), d, uncached=5000, warm=False)
    c2 = core(mode="colocated")
    both = c2.workers["w"] = worker("w", "both", load())
    assert not prefill_remotely(c2.config, c2.view(), both, uncached=5000, warm=False)
