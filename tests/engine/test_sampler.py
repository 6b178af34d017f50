"""The sampler's penalties and logprobs against straightforward reference implementations,
and prompt logprobs against one full forward pass."""

import pytest
import torch
from factories import make_engine, make_sequence

from pdserve.engine import sampler
from pdserve.engine.sampler import apply_penalties, sample
from pdserve.engine.sampling_params import SamplingParams


def reference_penalties(logits: torch.Tensor, seqs) -> torch.Tensor:
    """One sequence and one token at a time, as vLLM documents the three penalties."""
    out = logits.clone()
    for row, seq in zip(out, seqs, strict=True):
        p = seq.params
        outputs, prompt = seq.generated_token_ids, seq.prompt_token_ids
        for tok in range(row.shape[0]):
            if tok in outputs or tok in prompt:
                if p.repetition_penalty != 1.0:
                    r = p.repetition_penalty
                    row[tok] = row[tok] / r if row[tok] > 0 else row[tok] * r
            n = outputs.count(tok)
            row[tok] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
    return out


def test_penalties_are_exact_against_the_reference_and_leave_other_rows_alone():
    torch.manual_seed(0)
    vocab = 50
    cases = [
        dict(presence_penalty=0.7),
        dict(frequency_penalty=-0.4),
        dict(repetition_penalty=1.3),
        dict(),  # no penalty: untouched
        dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=0.8),
    ]
    seqs = []
    for i, params in enumerate(cases):
        prompt = torch.randint(0, vocab, (7 + i,)).tolist()
        seq = make_sequence(prompt, f"r{i}", max_tokens=30, **params)
        seq.token_ids += torch.randint(0, vocab, (3 * i + 1,)).tolist()  # outputs, repeats
        seqs.append(seq)
    seqs[2].num_replayed = 4  # a replayed request's outputs at the end of its prompt count
    logits = torch.randn(len(seqs), vocab) * 3
    expected = reference_penalties(logits, seqs)
    assert torch.equal(apply_penalties(logits, seqs), expected)
    assert seqs[2].generated_token_ids == seqs[2].token_ids[len(seqs[2].token_ids) - 7 - 4 :]


def test_penalties_before_any_output_touch_only_the_prompt_s_tokens():
    """The first step's rows: no output yet, so presence changes nothing and repetition
    only the prompt's tokens (the entries are computed sparsely: none at all here for a)."""
    torch.manual_seed(2)
    seqs = [
        make_sequence([1, 2, 3], "a", presence_penalty=1.0),
        make_sequence([4, 5, 4], "b", repetition_penalty=1.5),
        make_sequence([6], "c"),
    ]
    logits = torch.randn(3, 20)
    got = apply_penalties(logits, seqs)
    assert torch.equal(got, reference_penalties(logits, seqs))
    assert torch.equal(got[0], logits[0]) and (got[1] != logits[1]).sum() == 2


def test_logprobs_are_of_the_raw_logits_and_the_top_is_sorted():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    raw = logits.clone()  # the sampler leaves the logits as they are
    seqs = [
        make_sequence([1, 2, 3], "a", logprobs=5, presence_penalty=2.0),
        make_sequence([1, 2, 3], "b"),
        make_sequence([4], "c", logprobs=0, temperature=1.0, seed=3),
    ]
    seqs[0].token_ids.append(int(raw[0].argmax()))  # penalized: greedy picks another token
    tokens, lps = sample(logits, seqs)
    assert torch.equal(logits, raw)
    assert lps[1] is None and lps[2].top == ()
    expected = raw.log_softmax(-1)
    assert tokens[0] != seqs[0].token_ids[-1]
    assert lps[0].logprob == pytest.approx(float(expected[0, tokens[0]]), abs=1e-6)
    assert lps[2].logprob == pytest.approx(float(expected[2, tokens[2]]), abs=1e-6)
    top_ids = [t for t, _ in lps[0].top]
    assert top_ids == expected[0].topk(5).indices.tolist()
    assert [v for _, v in lps[0].top] == sorted((v for _, v in lps[0].top), reverse=True)


def test_penalties_change_greedy_outputs_in_the_engine(files):
    prompt = [5, 17, 33, 2, 9, 71, 8]
    eng = make_engine(files)
    base = eng.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True), "base")
    pen = eng.add_request(
        prompt, SamplingParams(max_tokens=20, ignore_eos=True, frequency_penalty=2.0), "pen"
    )
    while eng.has_work():
        eng.step()
    out = pen.output_token_ids
    assert len(set(out)) > len(set(base.output_token_ids))  # repeats are pushed down
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


@pytest.mark.parametrize("chunk", [None, 3])
def test_prompt_logprobs_equal_one_full_forward_pass(files, chunk):
    prompt = [5, 17, 33, 2, 9, 71, 8, 40, 41, 42, 43]
    eng = make_engine(files, chunk_size=chunk)
    warm = eng.add_request(prompt, SamplingParams(max_tokens=2))  # fills the prefix cache
    while eng.has_work():
        eng.step()
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, logprobs=2, ignore_eos=True)
    seq = eng.add_request(prompt, params)
    outs = []
    while eng.has_work():
        outs += eng.step()
    assert warm.output_token_ids
    assert seq.num_cached_tokens == 0  # no prefix hits: every position is computed
    assert len(seq.prompt_logprobs) == len(prompt) - 1
    ref = make_engine(files, enable_prefix_caching=False)
    ref_seq = ref.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3))
    while ref.has_work():
        ref.step()
    for got, want in zip(seq.prompt_logprobs, ref_seq.prompt_logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert len(got.top) == 3 and got.logprob <= got.top[0][1] + 1e-6
    mine = [o.logprobs for o in outs if o.seq is seq]
    assert len(mine) == 2 and all(len(lp.top) == 2 for lp in mine)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(presence_penalty=3),
        dict(repetition_penalty=0),
        dict(logprobs=21),
        dict(prompt_logprobs=-1),
    ],
)
def test_bad_penalty_and_logprob_params_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_logit_bias_forces_and_bans_tokens_batched():
    logits = torch.zeros(2, 10)
    seqs = [
        make_sequence([1], "a", logit_bias=((7, 100.0),)),
        make_sequence([1], "b", logit_bias=((0, -100.0), (1, -100.0))),
    ]
    logits[1, 0] = logits[1, 1] = 5.0  # the best two, banned
    tokens, _ = sample(logits, seqs)
    assert tokens[0] == 7 and tokens[1] not in (0, 1)
    assert logits[1, 0] == 5.0  # the caller's logits are left alone


def _drawn_params(n: int, **kw) -> tuple:
    """n sequences with the same sampling settings, and the extension's per-row tensors."""
    seqs = [make_sequence([1], f"r{i}", **kw) for i in range(n)]
    p = seqs[0].params
    return seqs, (
        torch.full((n,), p.temperature, dtype=torch.float32),
        torch.full((n,), p.top_k, dtype=torch.long),
        torch.full((n,), p.top_p, dtype=torch.float32),
    )


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.3, top_k=40),
    dict(temperature=0.5, top_k=100, top_p=0.5),
    dict(temperature=2.0, top_p=0.999),
]


@pytest.mark.parametrize("kw", SETTINGS)
def test_the_extension_draws_the_token_of_the_inverse_cdf_of_the_filtered_probabilities(ext, kw):
    """sample_rows against the torch path (`_filter`, softmax, cumulative sum): the same token
    for the same uniform, but where a uniform falls within rounding of a boundary."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 1000, generator=g) * 3
    seqs, (t, k, p) = _drawn_params(300, **kw)
    u = torch.rand(300, dtype=torch.float64, generator=g)
    ours = ext.sample_rows(logits, t, k, p, u).tolist()
    assert ours == sampler._inverse_cdf(logits, seqs, u)


@pytest.mark.parametrize("kw", SETTINGS)
def test_the_nucleus_and_the_top_k_are_the_torch_filter_s(ext, kw):
    """u just below 1 draws the last kept token in vocabulary order, u = 0 the first: both are
    the edges of what `_filter` keeps (distinct random logits: no ties at the edge)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(50, 2000, generator=g) * 4
    seqs, (t, k, p) = _drawn_params(50, **kw)
    kept = [
        torch.isfinite(sampler._filter(row / s.params.temperature, s.params.top_k, s.params.top_p))
        .nonzero()
        .view(-1)
        for row, s in zip(logits, seqs, strict=True)
    ]
    last = ext.sample_rows(logits, t, k, p, torch.full((50,), 1 - 1e-12, dtype=torch.float64))
    first = ext.sample_rows(logits, t, k, p, torch.zeros(50, dtype=torch.float64))
    assert last.tolist() == [int(x[-1]) for x in kept]
    assert first.tolist() == [int(x[0]) for x in kept]


def test_drawn_tokens_follow_the_distribution(ext):
    """20,000 draws over 6 tokens at temperature 0.8 with top_k 4: frequencies within 4.5
    standard deviations of softmax(logits / 0.8) over the four largest, none elsewhere."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.5, 3.0, 0.0]]).repeat(20000, 1)
    _, (t, k, p) = _drawn_params(20000, temperature=0.8, top_k=4)
    u = torch.rand(20000, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    counts = torch.bincount(ext.sample_rows(logits, t, k, p, u), minlength=6).double()
    expected = torch.zeros(6, dtype=torch.float64)
    top = logits[0].topk(4).indices
    expected[top] = (logits[0, top].double() / 0.8).softmax(-1)
    sd = (20000 * expected * (1 - expected)).sqrt()
    assert ((counts - 20000 * expected).abs() <= 4.5 * sd + 1e-9).all(), (counts, expected)


def test_masked_tokens_are_never_drawn_and_bad_rows_take_the_argmax(ext):
    """-inf logits (a grammar's mask, a ban) have no mass whatever u is; a row with a NaN, or
    with nothing finite, takes torch's argmax, as the torch path does."""
    logits = torch.full((5, 300), float("-inf"))
    logits[:3, 7] = 1.0
    logits[:3, 200] = 0.5
    logits[3, 10] = float("nan")  # the rest -inf: argmax is the first NaN
    # row 4: all -inf -> argmax 0
    seqs, (t, k, p) = _drawn_params(5, temperature=1.5, top_p=0.99)
    # weights 1 and exp(-0.5 / 1.5) = 0.72: u below 1 / 1.72 draws token 7, above it 200
    for uv, token in ((0.0, 7), (0.5, 7), (0.6, 200), (1 - 1e-15, 200)):
        u = torch.full((5,), uv, dtype=torch.float64)
        ours = ext.sample_rows(logits, t, k, p, u).tolist()
        assert ours == [token] * 3 + [10, 0]
        assert ours == sampler._inverse_cdf(logits, seqs, u)


def test_seeded_requests_draw_the_same_tokens_and_unseeded_rows_draw_in_one_batch(ext):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 500, generator=g)

    def draw(seed_of):
        seqs = [make_sequence([1], f"s{i}", temperature=1.0, seed=seed_of(i)) for i in range(8)]
        return [sample(logits, seqs)[0] for _ in range(3)]  # three steps of the same rows

    a, b = draw(lambda i: 100 + i), draw(lambda i: 100 + i)
    assert a == b  # each request's tokens depend on its seed alone
    assert draw(lambda i: 200 + i) != a
    mixed = [make_sequence([1], "g"), make_sequence([1], "t", temperature=1.0)]
    tokens, _ = sample(logits[:2], mixed)
    assert tokens[0] == int(logits[0].argmax())  # a greedy row beside a drawn one


def test_sampling_probs_are_the_torch_filter_s_softmax(ext):
    """What speculation's verify takes as the target's distribution: the kernel's kept weights
    over their total against `_filter` then softmax, row by row with its own settings; a row
    with nothing finite is NaN all along in both (verify then takes the argmax)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(len(SETTINGS) + 1, 1000, generator=g) * 3
    logits[-1] = float("-inf")
    params = [make_sequence([1], f"r{i}", **kw).params for i, kw in enumerate(SETTINGS)]
    params.append(params[0])
    ours = ext.sampling_probs(logits, *sampler._settings(params))
    ref = torch.stack(
        [
            sampler._filter(r / p.temperature, p.top_k, p.top_p)
            for r, p in zip(logits, params, strict=True)
        ]
    ).softmax(-1)
    assert torch.equal(ours[:-1] > 0, ref[:-1] > 0)  # the same tokens kept
    assert torch.allclose(ours[:-1], ref[:-1], rtol=1e-5, atol=1e-7)
    assert ours[-1].isnan().all() and ref[-1].isnan().all()
