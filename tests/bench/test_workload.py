import math

import numpy as np
import pytest

from pdserve.bench.workload import (
    LengthDist,
    RequestClass,
    Workload,
    arrival_times,
    generate_requests,
    named_workload,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512", LengthDist("fixed", mean=512)),
        ("fixed:512", LengthDist("fixed", mean=512)),
        ("uniform:100,300", LengthDist("uniform", low=100, high=300)),
        ("lognormal:1024,0.5", LengthDist("lognormal", mean=1024, sigma=0.5)),
        (" uniform: 1 , 2 ", LengthDist("uniform", low=1, high=2)),
    ],
)
def test_parse_accepts_each_form_and_round_trips(text, expected):
    dist = LengthDist.parse(text)
    assert dist == expected
    assert LengthDist.parse(str(dist)) == dist


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("gauss:3", "bad length distribution 'gauss:3'"),
        ("uniform:5", "uniform takes 2 number(s)"),
        ("uniform:a,b", "uniform takes 2 number(s)"),
        ("fixed:1.5", "1.5 is not a whole token count"),
        ("fixed:0", "fixed length must be a whole number >= 1"),
        ("uniform:300,100", "uniform lengths need 1 <= low <= high"),
        ("lognormal:1024,-1", "lognormal lengths need mean >= 1 and sigma >= 0"),
        ("", "bad length distribution ''"),
    ],
)
def test_parse_errors_say_what_was_wrong(text, fragment):
    with pytest.raises(ValueError) as info:
        LengthDist.parse(text)
    assert fragment in str(info.value)


def test_samples_stay_in_range():
    rng = np.random.default_rng(0)
    assert LengthDist.fixed(7).sample(rng, 3).tolist() == [7, 7, 7]
    uniform = LengthDist.uniform(3, 5).sample(rng, 2000)
    assert (uniform.min(), uniform.max()) == (3, 5)
    clipped = LengthDist.lognormal(10, 3.0, low=4, high=40).sample(rng, 2000)
    assert (clipped.min(), clipped.max()) == (4, 40)
    assert LengthDist.lognormal(1, 2.0).sample(rng, 2000).min() == 1


def test_lognormal_mean_is_the_arithmetic_mean():
    values = LengthDist.lognormal(1024, 0.5).sample(np.random.default_rng(1), 200_000)
    assert abs(values.mean() - 1024) < 5


def test_arrivals_have_the_requested_mean_rate_and_start_at_zero():
    for kind, burst in (("poisson", 1.0), ("gamma", 4.0), ("gamma", 0.25)):
        times = arrival_times(kind, 8.0, 20_001, seed=3, burstiness=burst)
        assert times[0] == 0.0
        assert np.all(np.diff(times) >= 0)
        assert abs(20_000 / times[-1] - 8.0) < 0.4


def test_burstiness_changes_the_spread_of_gaps():
    smooth = np.diff(arrival_times("gamma", 1.0, 5001, seed=0, burstiness=0.1))
    bursty = np.diff(arrival_times("gamma", 1.0, 5001, seed=0, burstiness=10.0))
    assert smooth.std() < 0.5 < 2.0 < bursty.std()


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times("poisson", math.inf, 4, seed=0).tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (("uniform", 1.0, 3, 0), "unknown arrival process 'uniform'"),
        (("poisson", 0.0, 3, 0), "request rate must be > 0"),
        (("gamma", 1.0, 3, 0, 0.0), "burstiness must be > 0"),
    ],
)
def test_arrival_errors(args, fragment):
    with pytest.raises(ValueError, match=fragment):
        arrival_times(*args)


def test_same_seed_same_requests_and_rate_only_moves_arrivals():
    work = named_workload("mixed")
    a = generate_requests(work, 200, seed=11, rate=2.0)
    assert a == generate_requests(work, 200, seed=11, rate=2.0)
    assert a != generate_requests(work, 200, seed=12, rate=2.0)
    b = generate_requests(work, 200, seed=11, rate=4.0)
    assert [r[2:] for r in a] == [r[2:] for r in b]
    assert [r.arrival_s * 2 for r in a] == pytest.approx([r.arrival_s * 4 for r in b])
    assert [r.index for r in a] == list(range(200))


def test_named_workloads_have_their_documented_shape():
    chat = generate_requests(named_workload("chat"), 500, seed=0)
    assert all(64 <= r.prompt_tokens <= 256 and 64 <= r.output_tokens <= 128 for r in chat)
    docs = generate_requests(named_workload("docs"), 500, seed=0)
    assert all(2048 <= r.prompt_tokens <= 8000 for r in docs)
    mixed = generate_requests(named_workload("mixed"), 2000, seed=0)
    docs_share = sum(r.klass == "doc" for r in mixed) / len(mixed)
    assert 0.08 < docs_share < 0.12


def test_unknown_workload_lists_the_names():
    with pytest.raises(ValueError, match="choose one of chat, docs, mixed"):
        named_workload("nope")


def test_workload_validation():
    d = LengthDist.fixed(1)
    with pytest.raises(ValueError, match="has no request classes"):
        Workload("w", ())
    with pytest.raises(ValueError, match="class names must be unique"):
        Workload("w", (RequestClass("a", 1, d, d), RequestClass("a", 1, d, d)))
    with pytest.raises(ValueError, match="weight must be > 0"):
        RequestClass("a", 0, d, d)
    custom = Workload.from_lengths(LengthDist.fixed(5), LengthDist.fixed(6))
    assert generate_requests(custom, 1, seed=0)[0][2:] == ("custom", 5, 6)


def test_multiturn_sessions_share_the_system_prompt_and_grow_turn_by_turn():
    from pdserve.bench.prompts import approximate_builder
    from pdserve.bench.workload import MT_SESSIONS, generate_requests, named_workload

    specs = generate_requests(named_workload("multiturn"), 3 * MT_SESSIONS, seed=0, rate=1.0)
    assert [s.prompt_tokens for s in specs[::MT_SESSIONS]] == [608, 736, 864]
    builder = approximate_builder(seed=0)
    first, second = builder.build(specs[0]), builder.build(specs[MT_SESSIONS])
    assert second.startswith(first)  # turn 2 of session 0 resends turn 1
    other = builder.build(specs[1])  # session 1: same system prompt, its own turns
    assert other.split()[:512] == first.split()[:512] and other != first
    assert len(second.split()) == 736
