"""`pdserve profile`: timing protocol and efficiency fit, against a fake engine with known costs."""

import json
from types import SimpleNamespace

import pytest

from pdserve.sim.calibration import load_profile, profile_document
from pdserve.sim.hardware import Accelerator
from pdserve.sim.latency import Batch, Efficiency, LatencyModel, stretch_time
from pdserve.sim.models import from_engine_config
from pdserve.sim.profile import EFF_GRID, fit_efficiency, measure_engine

CPU = Accelerator("cpu", "test cpu", 100e9, 10e9, 16e9, "pcie-gen4", 1)
CONFIG = SimpleNamespace(
    num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
    intermediate_size=1536, vocab_size=49152,
)  # fmt: skip
# True values on the fit's grids are recovered exactly.
TRUE = Efficiency(EFF_GRID[27], EFF_GRID[25], 0.003, 0.0005, attn_eff=0.25, half_tokens=16.0,
                  per_cached_token_s=2e-6)  # fmt: skip


class FakeLLM:
    """Advances a fake clock by the latency model's time for each generate() call."""

    def __init__(self) -> None:
        self.model_config = CONFIG
        self.now = 0.0
        self.calls: list[tuple[int, int, int]] = []
        self.latency = LatencyModel(from_engine_config(CONFIG), CPU, 1, TRUE, "fp32", "fp32")

    def generate(self, prompts, max_tokens):
        b, p = len(prompts), len(prompts[0])
        self.calls.append((b, p, max_tokens))
        self.now += self.latency.iteration(Batch(b * p, b, b * p * p / 2, 0, b))
        for j in range(1, max_tokens):
            self.now += self.latency.iteration(Batch(b, b, b * (p + j), b * (p + j), b))
        return [SimpleNamespace(token_ids=[1] * max_tokens) for _ in prompts]


def test_measure_engine_follows_the_protocol():
    llm = FakeLLM()
    points = measure_engine(llm, lambda n: n, ((1, 32), (2, 64)), ((4, 16),), 8, lambda: llm.now)
    assert llm.calls == [(1, 16, 2), (1, 32, 1), (2, 64, 1), (4, 16, 9), (4, 16, 1)]
    assert [(p.phase, p.batch_size, p.tokens) for p in points] == [
        ("prefill", 1, 32), ("prefill", 2, 64), ("decode", 4, 16),
    ]  # fmt: skip
    lat = llm.latency
    decode = sum(lat.iteration(Batch(4, 4, 4 * (16 + j), 4 * (16 + j), 4)) for j in range(1, 9))
    assert points[2].seconds == pytest.approx(decode / 8, rel=1e-12)


def test_fit_recovers_known_efficiencies(tmp_path):
    llm = FakeLLM()
    points = measure_engine(llm, lambda n: n, clock=lambda: llm.now)
    fit = fit_efficiency(points, from_engine_config(CONFIG), CPU, "fp32")
    eff = fit.efficiency
    assert (eff.mfu, eff.mbu, eff.half_tokens) == (TRUE.mfu, TRUE.mbu, 16.0)
    assert eff.iteration_overhead_s == pytest.approx(0.003, rel=1e-6)
    assert eff.per_seq_overhead_s == pytest.approx(0.0005, rel=1e-6)
    assert eff.attn_eff == pytest.approx(0.25, rel=1e-6)
    assert eff.per_cached_token_s == pytest.approx(2e-6, rel=1e-6)
    assert fit.max_rel_error < 1e-6
    doc = profile_document(CPU.__dict__ | {"tp_link": "pcie-gen4"}, from_engine_config(CONFIG),
                           "fp32", points, fit, 8)  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    prof = load_profile(path)
    assert (prof.accelerator, prof.efficiency, prof.weight_dtype) == (CPU, fit.efficiency, "fp32")


def test_bad_profiles(tmp_path):
    with pytest.raises(ValueError, match="does not exist; create it with `pdserve profile`"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "p.json").write_text(json.dumps({"version": 1, "hardware": {}}))
    with pytest.raises(ValueError, match="not a valid pdserve profile"):
        load_profile(tmp_path / "p.json")
    with pytest.raises(ValueError, match="at least 2 measurements"):
        fit_efficiency([], from_engine_config(CONFIG), CPU, "fp32")


@pytest.mark.slow
def test_profile_real_engine_smoke(tmp_path):
    from pdserve.cli import main

    out = tmp_path / "profile.json"
    args = ["profile", "--out", str(out), "--quick"]
    assert main(args) == 0
    prof = load_profile(out)
    assert prof.model.num_layers == 30 and 0 < prof.efficiency.mfu <= 1


def test_each_point_is_the_median_of_its_repeats():
    # Of three timings one is true, one twice as fast, one twice as slow (decode: the pair of
    # calls alike): the median is the true cost; the fastest would be half of it.
    llm = FakeLLM()
    # warm-up, then three rounds over the grid (prefill, decode pair): one true, one fast, one slow
    scales = iter([1.0] + [1.0, 1.0, 1.0] + [0.5, 0.5, 0.5] + [2.0, 2.0, 2.0])

    def generate(prompts, max_tokens, base=llm.generate):
        start = llm.now
        out = base(prompts, max_tokens)
        llm.now = start + (llm.now - start) * next(scales)
        return out

    llm.generate = generate
    points = measure_engine(llm, lambda n: n, ((1, 32),), ((4, 16),), 8, lambda: llm.now, 3)
    # repeats in rounds over the whole grid, so a slow stretch of the machine hits every point
    assert llm.calls[1:] == [(1, 32, 1), (4, 16, 9), (4, 16, 1)] * 3
    lat = llm.latency
    assert points[0].seconds == pytest.approx(lat.iteration(Batch(32, 1, 32 * 16, 0, 1)))
    decode = sum(lat.iteration(Batch(4, 4, 4 * (16 + j), 4 * (16 + j), 4)) for j in range(1, 9))
    assert points[1].seconds == pytest.approx(decode / 8, rel=1e-9)


def test_decode_stretch_agrees_with_the_iteration_it_sums():
    # The stretch's closed form carries every per-context cost (attention, cached-token reads)
    # the iteration does, step by step as the context grows.
    lat = LatencyModel(from_engine_config(CONFIG), CPU, 1, TRUE, "fp32", "fp32")
    steps = [lat.iteration(Batch(4, 4, 4 * 300 + 4 * i, 4 * 300 + 4 * i, 4)) for i in range(5)]
    assert stretch_time(lat.decode_coeffs(4, 4 * 300), 5) == pytest.approx(sum(steps), rel=1e-12)
