"""SLO-aware admission control in the router (unit level: no workers, no sockets used)."""

from __future__ import annotations

import pytest
from factories import make_engine, run_to_completion

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_perf import StepPerf
from pdserve.router.admission import Overloaded, check_slo

from .conftest import load, pending, worker


def test_ttft_estimate_refuses_with_retry_after(core):
    c = core(slo_ttft_s=1.0)
    d = c.workers["d"] = worker("d", "both", load(prefill_tok_s=100.0))
    check_slo(c.config, c.view(), d, remote=False, uncached=50)  # nothing queued: admitted
    pending(c, "r0", 80, remote=False, decode_id="d")
    check_slo(c.config, c.view(), d, remote=False, uncached=0)  # 0.8 s: within 80 % of the SLO
    with pytest.raises(Overloaded):
        check_slo(c.config, c.view(), d, remote=False, uncached=20)  # 1.0 s: no headroom left
    with pytest.raises(Overloaded) as exc:
        check_slo(c.config, c.view(), d, remote=False, uncached=300)  # (80 + 300) / 100 = 3.8 s
    assert exc.value.reason == "slo_ttft"
    assert exc.value.retry_after_s == 3  # ceil(3.8 - 0.8 x 1.0)
    assert "3.80 s" in str(exc.value) and "80 prompt tokens queued" in str(exc.value)


def test_a_lone_request_is_never_refused_for_its_own_size(core):
    c = core(slo_ttft_s=0.1, slo_tpot_s=0.01)
    d = c.workers["d"] = worker("d", "both", load(prefill_tok_s=10.0, decode_step_s=5.0))
    check_slo(
        c.config, c.view(), d, remote=False, uncached=10_000
    )  # 1000 s alone, but nothing ahead


def test_remote_prefill_uses_the_prefill_pools_backlog_and_speed(core):
    c = core(slo_ttft_s=2.0)
    d = c.workers["d"] = worker("d", "decode", load())
    c.workers["p0"] = worker("p0", "prefill", load(prefill_tok_s=300.0))
    c.workers["p1"] = worker("p1", "prefill", load(prefill_tok_s=300.0))
    pending(c, "local", 5000, remote=False, decode_id="d")  # D's own queue: not the pool's
    pending(c, "r0", 600, remote=True, decode_id="d")
    assert c.view().queued(remote=True, decode_id="d") == 600
    check_slo(
        c.config, c.view(), d, remote=True, uncached=360
    )  # 960 / 600 tok/s = 1.6 s = 0.8 x SLO
    with pytest.raises(Overloaded):
        check_slo(c.config, c.view(), d, remote=True, uncached=700)
    c.requests["r0"].tokens.append(7)  # its first token arrived: no longer waiting
    check_slo(c.config, c.view(), d, remote=True, uncached=700)


def test_tpot_refuses_only_a_busy_decodeworker(core):
    c = core(slo_tpot_s=0.1)
    d = c.workers["d"] = worker("d", "decode", load(decode_step_s=0.25))
    check_slo(c.config, c.view(), d, remote=False, uncached=10)  # idle: its old figure is stale
    pending(c, "r0", 10, remote=False, decode_id="d")
    with pytest.raises(Overloaded) as exc:
        check_slo(c.config, c.view(), d, remote=False, uncached=10)
    assert exc.value.reason == "slo_tpot" and "250 ms" in str(exc.value)
    assert exc.value.retry_after_s == 2
    d.load = load(decode_step_s=0.08)  # within the SLO, but without room for another stream
    with pytest.raises(Overloaded):
        check_slo(c.config, c.view(), d, remote=False, uncached=10)
    d.load = load(decode_step_s=0.07)
    check_slo(c.config, c.view(), d, remote=False, uncached=10)


def test_off_by_default_and_unmeasured_workers_admit(core):
    c = core()
    d = c.workers["d"] = worker("d", "both", load(prefill_tok_s=1.0, decode_step_s=9.0))
    pending(c, "r0", 10_000, remote=False, decode_id="d")
    check_slo(c.config, c.view(), d, remote=False, uncached=10_000)
    c2 = core(slo_ttft_s=0.5, slo_tpot_s=0.05)
    d2 = c2.workers["d"] = worker("d", "both", None)  # no heartbeat yet
    pending(c2, "r0", 10_000, remote=False, decode_id="d")
    check_slo(c2.config, c2.view(), d2, remote=False, uncached=10_000)


def test_step_perf_moving_averages():
    perf = StepPerf()
    perf.observe(prefill_tokens=8, decode_seqs=0, start=0.0, end=1.0)  # too few prompt tokens
    assert perf.prefill_tok_s == 0.0 and perf.decode_step_s == 0.0
    perf.observe(prefill_tokens=200, decode_seqs=0, start=1.0, end=2.0)
    assert perf.prefill_tok_s == 200.0
    perf.observe(prefill_tokens=400, decode_seqs=2, start=5.0, end=6.0)  # after a prefill-only
    assert perf.prefill_tok_s == pytest.approx(0.8 * 200 + 0.2 * 400)
    assert perf.decode_step_s == 1.0  # ... step, only its own duration counts
    perf.observe(prefill_tokens=0, decode_seqs=2, start=6.2, end=6.5)  # 0.2 s between steps
    assert perf.decode_step_s == pytest.approx(0.8 * 1.0 + 0.2 * 0.5)


def test_engine_reports_its_measured_speed():
    engine = make_engine()
    assert engine.stats()["prefill_tok_s"] == 0.0
    prompts = [list(range(1, 40)), list(range(2, 30))]
    run_to_completion(engine, prompts, SamplingParams(max_tokens=4))
    st = engine.stats()
    assert st["prefill_tok_s"] > 0 and st["decode_step_s"] > 0


def test_warm_up_measures_and_leaves_nothing_behind():
    engine = make_engine()
    engine.warm_up(prompt_tokens=40, decode_steps=3)
    st = engine.stats()
    assert st["prefill_tok_s"] > 0 and st["decode_step_s"] > 0
    assert st["free_blocks"] == st["total_blocks"] and not engine.has_work()
    assert engine.block_manager.drain_events() == []
    engine.check_integrity()


def test_with_the_autoscaler_admission_refuses_only_what_the_largest_pools_could_not_serve(core):
    """--autoscale --max-prefill 3 --max-decode 2: the TTFT estimate uses three prefill workers'
    speed while one runs, and TPOT refuses only once the decode pool is at its largest."""
    c = core(slo_ttft_s=2.0, slo_tpot_s=0.1, autoscale_max=(3, 2))
    d = c.workers["d"] = worker("d", "decode", load(decode_step_s=0.25))
    c.workers["p0"] = worker("p0", "prefill", load(prefill_tok_s=300.0))
    pending(c, "r0", 600, remote=True, decode_id="d")
    # one worker: (600 + 800) / 300 = 4.7 s; three: 1.6 s = 0.8 x SLO -> admitted
    check_slo(c.config, c.view(), d, remote=True, uncached=840)
    with pytest.raises(Overloaded, match="900 tokens/s"):  # beyond even three workers
        check_slo(c.config, c.view(), d, remote=True, uncached=1200)
    c.workers["d2"] = worker("d2", "decode", load(decode_step_s=0.25))
    with pytest.raises(Overloaded) as exc:  # two decode workers: the largest pool, TPOT counts
        check_slo(c.config, c.view(), d, remote=True, uncached=10)
    assert exc.value.reason == "slo_tpot"
    c.workers["d2"].draining = True  # a draining worker is not part of the pool
    check_slo(c.config, c.view(), d, remote=True, uncached=840)
