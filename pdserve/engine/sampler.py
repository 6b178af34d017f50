"""Token sampling for a batch: logprobs of the raw logits, penalties (presence, frequency,
repetition) and logit biases as batched tensor ops, then greedy, or temperature / top-k / top-p with
per-request seeded generators."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.engine.guided import apply_bitmask
from pdserve.engine.sequence import Sequence
from pdserve.model.extension import loaded_or_none


class TokenLogprobs(NamedTuple):
    """The chosen (or, for a prompt, the actual next) token's logprob and the top ones."""

    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: list[int]) -> list:
    """TokenLogprobs for each row of float32 logits (N, V): chosen[i]'s and the top k[i]."""
    logp = logits.log_softmax(-1)
    picked = logp.gather(1, chosen.view(-1, 1)).view(-1).tolist()
    kmax = max(k)
    top_v, top_i = logp.topk(kmax, -1) if kmax else (None, None)
    out = []
    for row, (lp, n) in enumerate(zip(picked, k, strict=True)):
        ids, values = (top_i[row, :n].tolist(), top_v[row, :n].tolist()) if n else ([], [])
        top = tuple(zip(ids, values, strict=True))
        out.append(TokenLogprobs(lp, top))
    return out


def _keys(rows: dict[int, list[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token id) pairs of `rows` (row -> ids) as flat indices
    row * vocab + id, and how often each occurs."""
    flat = [r * vocab + t for r, ids in rows.items() for t in ids]
    return torch.tensor(flat, dtype=torch.long).unique(return_counts=True)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The penalized logits, as vLLM and OpenAI define them: repetition divides a positive
    logit (and multiplies a negative one) of every token seen in the prompt or the output;
    frequency subtracts its count in the output, presence subtracts once if it is there.
    Only the (row, token) entries seen are computed (a dense count over a 49,152-token
    vocabulary cost 15-33 ms a step of 64 rows)."""
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not rows:
        return logits
    vocab = logits.shape[1]
    out_keys, out_n = _keys({i: seqs[i].generated_token_ids for i in rows}, vocab)
    keys, counts = out_keys, out_n.float()
    rep_any = any(seqs[i].params.repetition_penalty != 1.0 for i in rows)
    if rep_any:  # every token of the prompt too, with no count of its own
        prompt_keys, _ = _keys({i: seqs[i].prompt_token_ids for i in rows}, vocab)
        keys, where = torch.cat([out_keys, prompt_keys]).unique(return_inverse=True)
        counts = torch.zeros(len(keys)).index_put_(
            (where[: len(out_keys)],), out_n.float(), accumulate=True
        )
    row = keys // vocab

    def param(name: str) -> torch.Tensor:  # each entry's row's setting
        return torch.tensor([getattr(s.params, name) for s in seqs])[row]

    logits = logits.clone()
    flat = logits.view(-1)
    x = flat[keys]
    if rep_any:
        rep = param("repetition_penalty")
        x = torch.where(x > 0, x / rep, x * rep)
    freq, pres = param("frequency_penalty"), param("presence_penalty")
    flat[keys] = x - (freq * counts + pres * (counts > 0))
    return logits


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits + each request's logit_bias (ids beyond the vocabulary are refused earlier)."""
    pairs = [(i, t, b) for i, s in enumerate(seqs) for t, b in s.params.logit_bias]
    if not pairs:
        return logits
    rows, cols, bias = zip(*pairs, strict=True)
    logits = logits.clone()
    logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(bias), accumulate=True)
    return logits


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits (V,) outside the top-k and the top-p nucleus with -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, as torch's; by the extension's kernel (csrc/decode.cpp
    `argmax_rows`, ~15x torch's at 64 rows) where this process has loaded it."""
    ext = loaded_or_none()
    if ext is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
        return ext.argmax_rows(logits).tolist()
    return logits.argmax(-1).tolist()


def generator_of(seq: Sequence) -> torch.Generator | None:
    """seq's own generator, made from its seed at first use (None without a seed: torch's
    default one)."""
    if seq.params.seed is not None and seq.generator is None:
        seq.generator = torch.Generator().manual_seed(seq.params.seed)
    return seq.generator


def uniform(seq: Sequence) -> float:
    """One uniform in [0, 1) from seq's generator (`generator_of`)."""
    return float(torch.rand((), dtype=torch.float64, generator=generator_of(seq)))


def _uniforms(seqs: list[Sequence]) -> torch.Tensor:
    """One uniform in [0, 1) per row, float64: a seeded request's from its own generator (so its
    tokens depend on its seed alone), the others' from torch's default one in one draw."""
    u = torch.rand(len(seqs), dtype=torch.float64)
    for i, seq in enumerate(seqs):
        if seq.params.seed is not None:
            u[i] = uniform(seq)
    return u


def draw_from(probs: torch.Tensor, u: float) -> int:
    """The token of probabilities (V,) (zeros allowed, total > 0) at uniform u in [0, 1): the
    first whose running sum passes u times the total (the last one with any mass if rounding
    leaves none), as the extension's `sample_rows` draws."""
    cum = probs.double().cumsum(-1)
    pick = int(torch.searchsorted(cum, u * cum[-1], right=True))
    return min(pick, int(probs.nonzero()[-1]))


def filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Each row's sampling distribution (R, V) float32 (temperature, top-k, top-p of its
    SamplingParams): the extension's `sampling_probs` where this process has it, torch's
    `_filter` and softmax per row elsewhere; a row whose settings leave no finite
    probabilities is NaN (its draw is the argmax)."""
    ext = loaded_or_none()
    if ext is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
        return ext.sampling_probs(logits, *_settings(params))
    return _torch_probs(logits, params)


def _torch_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """`filtered_probs` by torch ops, row by row: `_filter` and softmax."""
    rows = zip(logits, params, strict=True)
    return torch.stack([_filter(r / p.temperature, p.top_k, p.top_p) for r, p in rows]).softmax(-1)


def _settings(params: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Temperature (float32), top_k (int64) and top_p (float32) of each row, as the
    extension's sampling kernels take them."""
    return (
        torch.tensor([p.temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.long),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
    )


def _inverse_cdf(logits: torch.Tensor, seqs: list[Sequence], u: torch.Tensor) -> list[int]:
    """Row by row in torch, as the extension's `sample_rows` draws (csrc/sample_rows.h): the
    first token whose running sum of the filtered probabilities passes u times their total;
    the argmax where the settings leave no finite probabilities."""
    probs = _torch_probs(logits, [s.params for s in seqs])
    rows = zip(logits, probs, u.tolist(), strict=True)
    # degenerate settings (no finite probabilities): fall back to the argmax
    return [draw_from(q, ui) if torch.isfinite(q).all() else int(x.argmax()) for x, q, ui in rows]


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """Greedy rows take the argmax; the others are drawn by the inverse CDF (one uniform a row)
    from their temperature / top-k / top-p distribution, all at once by the extension's
    `sample_rows` where this process has it (per row in torch, softmax and multinomial took
    ~1 ms at a 49,152-token vocabulary, a top-p's sort ~4 ms: 66 / 258 ms for a step of 64)."""
    if all(s.params.greedy for s in seqs):
        return argmax_rows(logits)
    out = [0] * len(seqs)
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    drawn = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if greedy:
        for i, tok in zip(greedy, argmax_rows(logits[greedy]), strict=True):
            out[i] = tok
    rows = logits if not greedy else logits[drawn]  # (a copy of 64 rows took ~1 ms)
    params = [seqs[i].params for i in drawn]
    u = _uniforms([seqs[i] for i in drawn])
    ext = loaded_or_none()
    if ext is not None and rows.dtype == torch.float32 and rows.device.type == "cpu":
        tokens = ext.sample_rows(rows, *_settings(params), u).tolist()
    else:
        tokens = _inverse_cdf(rows, [seqs[i] for i in drawn], u)
    for i, tok in zip(drawn, tokens, strict=True):
        out[i] = tok
    return out


def process(logits: torch.Tensor, seqs: list, bitmask: torch.Tensor | None = None):
    """The logits a row is drawn from: penalties, then logit bias, then the grammar's mask
    (`bitmask`). A new tensor when any applies (the raw logits give the logprobs). `seqs`:
    each row's sequence, or anything with its params and token ids (speculation's rows)."""
    processed = apply_logit_bias(apply_penalties(logits, seqs), seqs)
    if bitmask is not None:
        processed = processed.clone() if processed is logits else processed
        apply_bitmask(processed, bitmask)
    return processed


def sample(
    logits: torch.Tensor, seqs: list[Sequence], bitmask: torch.Tensor | None = None
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of logits (N, V), float32; row i belongs to seqs[i]. `bitmask`:
    the guided rows' allowed tokens (engine/guided.py). Logprobs (of the raw logits, as vLLM
    reports them) for the rows that ask."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    tokens = _draw(process(logits, seqs, bitmask), seqs)
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    if want:
        chosen = torch.tensor([tokens[i] for i in want])
        k = [seqs[i].params.logprobs for i in want]
        for i, lp in zip(want, token_logprobs(logits[want], chosen, k), strict=True):
            logprobs[i] = lp
    return tokens, logprobs
