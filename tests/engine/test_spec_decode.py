"""Speculative decoding (engine/spec_decode.py) on a tiny random model: greedy outputs identical
with and without prompt-lookup speculation (fused and eager steps, batched with sequences that
do not speculate) and with a draft model (the target itself, or another of its vocabulary),
rejection sampling preserves the target distribution (chi-square), block accounting exact after
rejections, preemption and aborts, bad configs refused."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.spec_decode import (
    NgramProposer,
    parse_speculative_config,
    processed_logits,
    verify,
)
from tests.factories import make_engine, make_model_files, make_sequence

SPEC = json.dumps(  # three sequences speculate at once
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
     "prompt_lookup_max": 3, "disable_by_batch_size": 3}
)  # fmt: skip
# prompts that repeat themselves, so that prompt lookup proposes
PROMPTS = [[5, 6, 7, 8, 9, 10] * 4 + [5, 6], [20, 21, 22, 23] * 5, [40 + i % 7 for i in range(30)]]


@pytest.fixture
def one_thread():
    """Tiny tensor ops: on a loaded machine a second torch thread costs 30x in waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def files():
    return make_model_files()


def run(engine, prompts, params_list, abort_after: dict | None = None):
    seqs = [engine.add_request(list(p), q) for p, q in zip(prompts, params_list, strict=True)]
    engine.seen = [*getattr(engine, "seen", []), *seqs]  # every sequence, finished or aborted
    steps = 0
    while engine.has_work():
        engine.step()
        engine.check_integrity()
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(rid)
    return [s.output_token_ids for s in seqs]


def assert_clean(engine):
    bm = engine.block_manager
    engine.check_integrity()
    assert bm.num_free_blocks == bm.num_blocks
    # the prefix cache holds only verified tokens: each cached block is a block of a finished
    # sequence's tokens at its place
    for block in bm.blocks:
        if block.hash is not None:
            assert any(
                tuple(s[i : i + bm.block_size]) == block.token_ids
                for s in (q.token_ids for q in engine.seen)
                for i in range(0, len(s), bm.block_size)
            ), f"block {block.block_id} caches tokens no sequence had"


@pytest.mark.parametrize("eager", [False, True], ids=["fused", "eager"])
def test_greedy_identical_batched_with_plain_sequences(files, eager):
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    penalized = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.5)
    logprobs = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    params = [greedy, penalized, logprobs]
    base = run(make_engine(files, enforce_eager=eager), PROMPTS, params)
    engine = make_engine(files, enforce_eager=eager, speculative_config=SPEC)
    assert run(engine, PROMPTS, params) == base
    st = engine.stats()
    assert st["spec_verify_steps"] > 0 and st["spec_proposed_tokens"] > 0
    assert st["spec_accepted_tokens"] > 0, st
    assert 0 < st["spec_acceptance_rate"] <= 1 and st["spec_mean_accepted_len"] > 1
    assert_clean(engine)


def test_penalized_sequences_speculate_with_the_plain_tokens(files):
    """Each verify row is penalized as if the proposals before it had been emitted."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.02,
                            frequency_penalty=0.01, repetition_penalty=1.01)  # fmt: skip
    base = run(make_engine(files), PROMPTS, [params] * 3)
    engine = make_engine(files, speculative_config=SPEC)
    assert run(engine, PROMPTS, [params] * 3) == base
    assert engine.stats()["spec_accepted_tokens"] > 0
    assert_clean(engine)


def test_each_verify_row_counts_the_proposals_before_it_as_emitted():
    seq = make_sequence(
        [1, 2, 3], frequency_penalty=1.0, presence_penalty=0.5, logit_bias=[(9, 2.0)]
    )
    seq.token_ids.append(7)  # one output token so far
    rows = processed_logits(torch.zeros(3, 16), seq, [7, 7])
    assert rows[:, 7].tolist() == [-1.5, -2.5, -3.5]  # 1, 2, 3 sevens emitted before the row
    assert rows[:, 9].tolist() == [2.0] * 3 and rows[:, 4].tolist() == [0.0] * 3
    logits = torch.zeros(3, 16)
    logits[:, 7] = 3.8  # raw argmax 7 everywhere; penalized, 9 (bias 2.0) wins from row 1 on
    assert verify(logits, seq, [7, 7]) == [7, 9]


def test_the_ngram_index_grown_step_by_step_proposes_what_a_full_scan_would():
    import random

    def scan(tokens, k, lo, hi):  # every window of the whole context, each call
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            hits = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
            if hits:
                return tokens[hits[0] + n : hits[0] + n + k]
        return []

    rng = random.Random(0)
    cfg = parse_speculative_config(SPEC)
    for trial in range(20):
        prop = NgramProposer(cfg, 100)
        seq = make_sequence([rng.randrange(6) for _ in range(rng.randrange(1, 12))])
        for _ in range(40):
            k = rng.randrange(1, 5)
            assert prop.propose(seq, k) == scan(seq.token_ids, k, 1, 3), (trial, seq.token_ids)
            seq.token_ids.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))


def test_max_tokens_stops_and_adaptive_batch_limit(files):
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    base = run(make_engine(files), PROMPTS, [params] * 3)
    engine = make_engine(files, speculative_config=SPEC)
    out = run(engine, PROMPTS, [params] * 3)
    assert out == base and all(len(o) == 7 for o in out)
    off = json.dumps({**json.loads(SPEC), "disable_by_batch_size": 2})
    engine = make_engine(files, speculative_config=off)
    assert run(engine, PROMPTS, [params] * 3) == base
    assert engine.stats()["spec_verify_steps"] == 0  # three decoding: above the limit


def test_blocks_exact_after_preemption_and_abort(files):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    base = run(make_engine(files, kv_cache_gb=0.00004), PROMPTS, [params] * 3)
    engine = make_engine(files, kv_cache_gb=0.00004, speculative_config=SPEC)
    assert run(engine, PROMPTS, [params] * 3) == base
    assert engine.scheduler.num_preemptions > 0  # the small cache forced some
    assert engine.stats()["spec_verify_steps"] > 0
    assert_clean(engine)
    engine = make_engine(files, speculative_config=SPEC)
    out = run(engine, PROMPTS, [params] * 3, abort_after={"req-1": 4})
    assert out[0] == base[0] and len(out[1]) < 40
    assert_clean(engine)


def test_ngram_proposer_takes_earliest_longest_match():
    cfg = parse_speculative_config(SPEC)
    prop = NgramProposer(cfg, 100)
    seq = make_sequence([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert prop.propose(seq, 3) == [9, 1, 2]
    assert prop.propose(make_sequence([1, 2, 3, 4]), 3) == []


def test_rejection_sampling_preserves_the_distribution(one_thread):
    """Chi-square over seeded draws (vocab 8): the first emitted token follows the target's p0
    whatever the draft; the second, after an accepted draft, follows p1."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, generator=gen) * 1.5
    seq = make_sequence([1, 2, 3], temperature=0.8, top_k=6, seed=1)

    def probs(row):
        kth = torch.topk(row, 6).values[-1]
        return (row / 0.8).masked_fill(row < kth, float("-inf")).softmax(-1)

    d0 = int(probs(logits[0]).argmax())  # often accepted: the second position gets draws
    draws = 4000
    first, second = torch.zeros(8), torch.zeros(8)
    for _ in range(draws):
        out = verify(logits, seq, [d0, 5])
        first[out[0]] += 1
        if out[0] == d0:
            second[out[1]] += 1
    plain = torch.zeros(8)  # the plain sampler on the same row, for comparison
    for tok in sample(logits[:1].expand(400, 8), [make_sequence([1], temperature=0.8, top_k=6,
                                                              seed=2)] * 400)[0]:  # fmt: skip
        plain[tok] += 1

    def chi2(counts, p):
        exp = p * counts.sum()
        keep = exp > 0
        assert counts[~keep].sum() == 0  # never a token the target cannot draw
        return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())

    crit = 20.5  # chi-square with 5 degrees of freedom (top-6), p = 0.001
    assert chi2(first, probs(logits[0])) < crit
    assert chi2(plain, probs(logits[0])) < crit
    assert second.sum() > 800
    assert chi2(second, probs(logits[1])) < crit
    # and a draft the target never draws is always rejected
    banned = int(logits[0].argmin())
    assert all(verify(logits, seq, [banned, 5])[0] != banned for _ in range(50))


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"method": "eagle9", "num_speculative_tokens": 2}', "unknown method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
        ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown fields ['k']"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),  # fmt: skip
        (
            '{"method": "draft", "num_speculative_tokens": 2, "model": "/no/such"}',
            "the draft model: model path /no/such does not exist",
        ),
        ('{"method": "draft", "num_speculative_tokens": 2}', "'draft' needs 'model'"),
        ("{nope", "not valid JSON"),
    ],
)
def test_bad_config_refused(text, needle):
    with pytest.raises(ValueError, match="speculative-config") as err:
        parse_speculative_config(text)
    assert needle in str(err.value)


def test_engine_refuses_bad_config_before_loading_the_model():
    """(`pdserve generate/worker/serve --speculative-config` print this and exit 1.)"""
    bad = '{"method": "nope", "num_speculative_tokens": 2}'
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        make_engine(files=object(), speculative_config=bad)  # never reaches the files


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """HF folders of tiny Qwen3 models: the target, another draft of its vocabulary, and one
    of a wider vocabulary."""
    from family_models import build

    out = {name: tmp_path_factory.mktemp(name) for name in ("target", "other", "wide")}
    build("qwen3", out["target"], seed=0)
    build("qwen3", out["other"], seed=1)
    build("qwen3", out["wide"], vocab_size=320)
    return out


@pytest.mark.parametrize("draft", ["target", "other"])
def test_a_draft_model_gives_the_plain_greedy_tokens_and_frees_its_blocks(folders, draft,
                                                                         one_thread):  # fmt: skip
    from pdserve.model.loader import load_model_files

    files = load_model_files(str(folders["target"]))
    spec = json.dumps({"method": "draft", "num_speculative_tokens": 3,
                       "model": str(folders[draft]), "disable_by_batch_size": 3})  # fmt: skip
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    penalized = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=0.5)
    params = [greedy, greedy, penalized]
    plain = run(make_engine(files), PROMPTS, params)
    engine = make_engine(files, speculative_config=spec)
    assert run(engine, PROMPTS, params) == plain
    stats, proposer = engine.stats(), engine.speculator.proposer
    assert stats["spec_proposed_tokens"] > 0
    if draft == "target":  # the same weights propose what the target then picks
        assert stats["spec_acceptance_rate"] > 0.9, stats
    assert_clean(engine)
    proposer.retain([])  # a proposal round with none of them running frees what is left
    assert not proposer.drafts and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def test_a_draft_of_another_vocabulary_is_refused_at_start_up(folders):
    from pdserve.model.loader import load_model_files

    spec = json.dumps({"method": "draft", "num_speculative_tokens": 2,
                       "model": str(folders["wide"])})  # fmt: skip
    with pytest.raises(ValueError, match="has a vocabulary of 320 tokens, the target 256"):
        make_engine(load_model_files(str(folders["target"])), speculative_config=spec)


def test_a_sequence_whose_proposals_fail_keeps_proposing_one_token():
    """No backing off: after verify steps that accept nothing, a sequence still proposes at
    every step where its n-gram matches, one token (its recent acceptance pays for no more);
    accepted proposals lengthen its proposals again."""
    from pdserve.engine.spec_decode import Speculator

    spec = Speculator(parse_speculative_config(SPEC), 100, 1000)
    seq = make_sequence([1, 2, 3, 1, 2, 3, 1, 2], max_tokens=50, ignore_eos=True)
    seq.token_ids.append(3)  # an output token: the sequence decodes
    seq.num_computed_tokens = seq.num_tokens - 1

    def verify_step(argmax: int) -> list[int]:
        spec.propose([seq])
        assert seq.spec_token_ids  # "... 2, 3" always matches
        logits = torch.full((len(seq.spec_token_ids) + 1, 100), -10.0)
        logits[:, argmax] = 10.0
        return [t for t, _ in spec.accept(seq, logits)]

    lengths = []
    for _ in range(10):  # proposed [1, 2, 3] (or fewer) after "... 2, 3": all rejected
        assert verify_step(argmax=7) == [7]
        lengths.append(len(seq.spec_token_ids))
        seq.token_ids[-1:] = [3]  # the context ends "... 2, 3" again
    assert lengths[0] == 3 and lengths[-1] == 1 and lengths == sorted(lengths, reverse=True)
    for _ in range(8):
        seq.token_ids[-1:] = [3]
        verify_step(argmax=1)  # the first proposal, 1, accepted
    assert len(seq.spec_token_ids) > 1


def test_a_sequence_proposes_as_many_tokens_as_its_recent_acceptance_pays_for():
    """proposal_length: the largest i with r^i above ROW_COST for the recent per-proposal
    acceptance r, 1 to num_speculative_tokens; each verify step's try updates r (a try ends at
    the first rejection, or after the last proposal)."""
    from pdserve.engine.spec_decode import Speculator, proposal_length

    seq = make_sequence([1, 2, 3, 1, 2, 3, 1, 2], max_tokens=50, ignore_eos=True)
    for hits, tries, want in [(3, 4, 4), (1, 2, 2), (0.2, 1, 1), (0, 1, 1), (1, 1, 4)]:
        seq.spec_hits, seq.spec_tries = hits, tries
        assert proposal_length(seq, 4) == want
    spec = Speculator(parse_speculative_config(SPEC), 100, 1000)
    seq.spec_hits, seq.spec_tries = 3.0, 4.0
    seq.spec_token_ids = [5, 6, 7]
    logits = torch.full((4, 100), -10.0)
    logits[0, 5] = logits[1, 9] = 10.0  # 5 accepted, 6 rejected: a try of 1 hit
    assert [t for t, _ in spec.accept(seq, logits)] == [5, 9]
    assert (seq.spec_hits, seq.spec_tries) == pytest.approx((0.7 * 3 + 1, 0.7 * 4 + 2))


def test_a_speculating_step_stays_within_the_rows_of_the_quantized_kernels(files):
    """Past the fewest rows a quantized linear runs its few-row kernel for, it switches to the
    dense GEMM (rounding differently: greedy tokens would differ): proposals stop there."""
    from pdserve.engine.spec_decode import Speculator, row_budget
    from pdserve.model.quant import quantized_linears

    model = make_engine(files, weights="int4").runner.model
    linears = quantized_linears(model)
    assert linears and row_budget(model) is None  # float32: the dense GEMM at every row count
    for i, linear in enumerate(linears):
        linear.max_rows = 9 if i == 1 else 16 if i % 2 else 0  # 0: never the few-row kernel
    assert row_budget(model) == 9
    spec = Speculator(parse_speculative_config(SPEC), 100, 1000)
    spec.row_budget = row_budget(model)
    seqs = []
    for i in range(3):
        seq = make_sequence([1, 2, 3, 4] * 4, f"r{i}", max_tokens=50, ignore_eos=True)
        seq.token_ids.append(1)  # an output token: the sequence decodes
        seq.num_computed_tokens = seq.num_tokens - 1
        seqs.append(seq)
    spec.propose(seqs)
    assert [len(s.spec_token_ids) for s in seqs] == [3, 3, 0]  # 3 rows + 6 proposals = 9
    spec.row_budget = None
    spec.propose(seqs)
    assert [len(s.spec_token_ids) for s in seqs] == [3, 3, 3]
