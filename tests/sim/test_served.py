"""Calibration from served steps (`pdserve.sim.served`, `pdserve profile --from-steps`): logs
written by an engine with known step costs are fitted back to those costs."""

import json
import random
from dataclasses import replace

import pytest

from pdserve.sim.calibration import load_profile, profile_document
from pdserve.sim.latency import Batch, LatencyModel
from pdserve.sim.models import from_engine_config
from pdserve.sim.profile import Point, fit_efficiency
from pdserve.sim.served import fit_steps, group_steps, read_steps, step_gaps
from tests.sim.test_profile import CONFIG, CPU, TRUE

MODEL = from_engine_config(CONFIG)
GAP_S, GAP_PER_SEQ_S = 0.0015, 0.0002


def served_batches(rng: random.Random, n: int) -> list[tuple[Batch, int]]:
    """(batch, prompt tokens in it) as a served engine runs them: decode steps of 1-8 streams at
    varied contexts, and now and then a prefill chunk beside them."""
    out = []
    for _ in range(n):
        seqs = rng.randint(1, 8)
        ctx = sum(rng.randint(50, 2000) for _ in range(seqs))
        prefill = rng.choice([0] * 6 + [32, 200, 1000, 3000])
        pairs = ctx + prefill * prefill / 2
        out.append((Batch(seqs + prefill, seqs + (prefill > 0), pairs, ctx, seqs + (prefill > 0)),
                    prefill))  # fmt: skip
    return out


def write_log(path, batches, latency, start=1000.0, noise=None):
    """Steps back to back, each `GAP_S + GAP_PER_SEQ_S x seqs` after the last; returns the
    (start, end) window they span."""
    t = start
    with path.open("w") as f:
        for b, prefill in batches:
            s = latency.iteration(b) * (noise() if noise else 1.0)
            rec = {"t": t, "s": s, "tokens": b.tokens, "sampled": b.sampled,
                   "pairs": b.attn_pairs, "kv_read": b.kv_read, "seqs": b.seqs,
                   "prefill_tokens": prefill}  # fmt: skip
            f.write(json.dumps(rec) + "\n")
            t += s + GAP_S + GAP_PER_SEQ_S * b.seqs
    return start, t


@pytest.fixture
def latency():
    return LatencyModel(MODEL, CPU, 1, TRUE, "fp32", "fp32")


def test_fit_to_served_steps_recovers_the_step_costs(tmp_path, latency):
    rng = random.Random(3)
    batches = served_batches(rng, 600)
    log = tmp_path / "steps-both-1.jsonl"
    write_log(log, batches, latency, noise=lambda: rng.uniform(0.97, 1.03))
    steps = read_steps(tmp_path)
    assert len(steps) == 600
    fit, accel = fit_steps(steps, MODEL, CPU, "fp32")
    fitted = LatencyModel(MODEL, accel, 1, fit.efficiency, "fp32", "fp32")
    probe = [
        Batch(1, 1, 100, 100, 1),
        Batch(8, 8, 8000, 8000, 8),
        Batch(2048, 1, 2048**2 / 2, 0, 1),
    ]
    for b in probe:  # shapes between and beyond the logged ones
        assert fitted.iteration(b) == pytest.approx(latency.iteration(b), rel=0.05)
    assert fit.median_rel_error < 0.03


def test_a_peak_measured_too_low_is_raised_not_fitted_around(tmp_path, latency):
    """A profile whose matmul peak caught a slow moment (a quarter of the true one) would pin
    mfu at 1 and distort the fit; the served fit raises the peak instead."""
    rng = random.Random(9)
    write_log(tmp_path / "steps-both-1.jsonl", served_batches(rng, 600), latency)
    low = replace(CPU, peak_flops=CPU.peak_flops / 4, mem_bytes_per_s=CPU.mem_bytes_per_s / 4)
    fit, accel = fit_steps(read_steps(tmp_path), MODEL, low, "fp32")
    assert accel.peak_flops > low.peak_flops and accel.mem_bytes_per_s > low.mem_bytes_per_s
    assert fit.efficiency.mfu < 1 and fit.efficiency.attn_eff < 1
    fitted = LatencyModel(MODEL, accel, 1, fit.efficiency, "fp32", "fp32")
    long_prefill = Batch(3000, 1, 3000**2 / 2, 0, 1)
    assert fitted.iteration(long_prefill) == pytest.approx(
        latency.iteration(long_prefill), rel=0.05
    )
    # a peak already high enough is kept
    _, same = fit_steps(read_steps(tmp_path), MODEL, replace(CPU, peak_flops=1e15), "fp32")
    assert same.peak_flops == 1e15


def test_step_gaps_are_the_worker_loop_between_decode_steps(tmp_path, latency):
    batches = [(b, 0) for b, _ in served_batches(random.Random(4), 300)]  # decode only
    write_log(tmp_path / "steps-decode-2.jsonl", batches, latency)
    step, seq = step_gaps(read_steps(tmp_path))
    assert step == pytest.approx(GAP_S, rel=1e-3) and seq == pytest.approx(GAP_PER_SEQ_S, rel=1e-3)


def test_windows_select_steps_and_logs_merge(tmp_path, latency):
    batches = served_batches(random.Random(5), 100)
    a = write_log(tmp_path / "steps-prefill-1.jsonl", batches[:50], latency, start=1000.0)
    b = write_log(tmp_path / "steps-decode-2.jsonl", batches[50:], latency, start=a[1] + 60)
    assert len(read_steps(tmp_path)) == 100
    assert {s.log for s in read_steps(tmp_path, inside=[a])} == {"steps-prefill-1.jsonl"}
    assert len(read_steps(tmp_path, outside=[a])) == 50
    assert read_steps(tmp_path, inside=[a, b], outside=[b]) == read_steps(tmp_path, inside=[a])
    # like shapes merge: fewer groups than steps, every step counted once
    assert sum(n for *_, n in group_steps(read_steps(tmp_path))) == 100


def test_a_torn_last_line_is_skipped_and_a_bad_line_is_named(tmp_path, latency):
    log = tmp_path / "steps-both-1.jsonl"
    write_log(log, served_batches(random.Random(6), 30), latency)
    with log.open("a") as f:
        f.write('{"t": 5, "s"')  # a worker killed mid-write
    assert len(read_steps(tmp_path)) == 30
    log.write_text('{"t": 1}\n' + log.read_text())
    with pytest.raises(ValueError, match=r"steps-both-1.jsonl:1 is not a step record"):
        read_steps(tmp_path)


def test_too_little_to_calibrate_says_what_to_do(tmp_path, latency):
    with pytest.raises(ValueError, match="pdserve serve --step-log DIR"):
        read_steps(tmp_path)
    write_log(tmp_path / "steps-both-1.jsonl", served_batches(random.Random(7), 5), latency)
    with pytest.raises(ValueError, match="at least 20"):
        fit_steps(read_steps(tmp_path), MODEL, CPU, "fp32")


def test_profile_from_steps_refits_a_profile_and_keeps_the_engine_fit(tmp_path, latency, capsys):
    from pdserve.cli import main

    points = [Point("prefill", 1, n, latency.prefill(n) * 1.5) for n in (32, 512, 2048)]
    points += [Point("decode", b, 64, latency.iteration_decode(b, b * 80) * 1.5) for b in (1, 8)]
    engine_fit = fit_efficiency(points, MODEL, CPU, "fp32")  # a profile 1.5x too slow
    hardware = {"name": "cpu", "description": "test", "peak_flops": CPU.peak_flops,
                "mem_bytes_per_s": CPU.mem_bytes_per_s, "mem_bytes": CPU.mem_bytes,
                "loopback_bytes_per_s": 1e9, "tp_link": "pcie-gen4", "max_tp": 1}  # fmt: skip
    out = tmp_path / "profile.json"
    out.write_text(json.dumps(profile_document(hardware, MODEL, "fp32", points, engine_fit, 32)))
    write_log(tmp_path / "steps-both-1.jsonl", served_batches(random.Random(8), 400), latency)
    assert main(["profile", "--from-steps", str(tmp_path), "--out", str(out)]) == 0
    assert "400 served steps" in capsys.readouterr().out
    prof = load_profile(out)
    served = LatencyModel(MODEL, prof.accelerator, 1, prof.efficiency, "fp32", "fp32")
    assert served.prefill(1024) == pytest.approx(latency.prefill(1024), rel=0.05)
    doc = json.loads(out.read_text())
    assert doc["engine_fit"]["efficiency"] == engine_fit.efficiency.__dict__
    assert doc["fit"]["served_steps"] == 400
    # no logs there: exit 2 with what to do
    assert main(["profile", "--from-steps", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "--step-log" in capsys.readouterr().err
