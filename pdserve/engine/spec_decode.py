"""Speculative decoding: a proposer guesses the next k tokens of a decoding sequence, one step
of the target model scores all k+1 positions, and the longest prefix the target agrees with is
kept (plus one token of the target's own), so an accepted guess is a token without a step.

`--speculative-config` takes vLLM's JSON fields (method, num_speculative_tokens,
prompt_lookup_min/max, model, disable_by_batch_size). Proposers are a registry (`PROPOSERS`);
`ngram` (prompt lookup, as vLLM's NgramProposer) is the one built. Verification (`verify`):
greedy keeps the longest prefix equal to the target's argmax; sampling is rejection sampling
(Leviathan et al., vLLM's RejectionSampler): a draft token d with draft probability q(d) is
accepted with min(1, p(d)/q(d)); the first rejected position samples from the residual
max(0, p - q) normalized; if every draft is accepted a bonus token is sampled from p at the
last position. For prompt lookup q is a point mass at d, so acceptance is p(d) and the residual
is p with d removed. The output's distribution is the target's.

Sequences with penalties (they depend on each earlier emitted token) or a grammar (its mask
would have to advance over unverified tokens) decode without speculation, one token a step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy as np
import torch

from pdserve.engine.sampler import TokenLogprobs, _filter, apply_logit_bias, token_logprobs
from pdserve.engine.sequence import Sequence

# Above this many decoding sequences in a step the step is no longer bandwidth bound and
# verification costs more than it gains: measured on this machine with benchmarks/spec_decode.py
# (docs/serving.md); `disable_by_batch_size` overrides it.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in PROPOSERS:
            raise ValueError(
                f"--speculative-config: unknown method {self.method!r}; "
                f"choose one of {sorted(PROPOSERS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError(
                f"--speculative-config: num_speculative_tokens must be >= 1, got {k!r}"
            )
        if self.disable_by_batch_size < 1:
            raise ValueError("--speculative-config: disable_by_batch_size must be >= 1")
        PROPOSERS[self.method].check(self)


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """A SpeculativeConfig from the flag's JSON (None/"" = off); ValueError saying what is wrong."""
    if text is None or text == "" or isinstance(text, SpeculativeConfig):
        return text or None
    if isinstance(text, str):
        try:
            text = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(text, dict):
        raise ValueError("--speculative-config must be a JSON object, e.g. "
                         '\'{"method": "ngram", "num_speculative_tokens": 4}\'')  # fmt: skip
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(text) - known)
    if unknown:
        raise ValueError(f"--speculative-config: unknown fields {unknown}; known: {sorted(known)}")
    for need in ("method", "num_speculative_tokens"):
        if need not in text:
            raise ValueError(f"--speculative-config needs {need!r}")
    return SpeculativeConfig(**text)


class NgramProposer:
    """Prompt lookup: the longest n-gram (prompt_lookup_max down to _min) ending the sequence
    that also occurs earlier in it (prompt or output); proposes the k tokens that followed its
    earliest occurrence (as vLLM's NgramProposer)."""

    def __init__(self, cfg: SpeculativeConfig, vocab_size: int):
        lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.min_n, self.max_n = (lo or hi or 5), (hi or lo or 5)
        self.k = cfg.num_speculative_tokens

    @staticmethod
    def check(cfg: SpeculativeConfig) -> None:
        lo, hi = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        lo, hi = (lo or hi or 5), (hi or lo or 5)
        if lo < 1 or hi < lo:
            raise ValueError(
                "--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {lo} and {hi}"
            )
        if cfg.model is not None:
            raise ValueError("--speculative-config: method 'ngram' takes no 'model'")

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = np.asarray(seq.token_ids, dtype=np.int64)
        n_tok = len(tokens)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tok - 1], n)
            hits = np.flatnonzero((windows == tokens[n_tok - n :]).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return tokens[start : start + k].tolist()
        return []


class DraftModelProposer:
    """`draft`: a smaller model of the same vocabulary. Not built yet: refused at start-up."""

    @staticmethod
    def check(cfg: SpeculativeConfig) -> None:
        raise ValueError(
            "--speculative-config: method 'draft' is not supported by this build yet; use 'ngram'"
        )


PROPOSERS = {"ngram": NgramProposer, "draft": DraftModelProposer}


def make_proposer(cfg: SpeculativeConfig, vocab_size: int):
    return PROPOSERS[cfg.method](cfg, vocab_size)


class Speculator:
    """The engine's side of speculative decoding: proposals for the decoding sequences before a
    step is scheduled (`propose`), the tokens each keeps after it (`accept`), and the counters
    `LLMEngine.stats` reports. Holds no sequence between steps."""

    def __init__(self, cfg: SpeculativeConfig, vocab_size: int, max_model_len: int) -> None:
        self.cfg = cfg
        self.proposer = make_proposer(cfg, vocab_size)
        self.max_model_len = max_model_len
        self.proposed = self.accepted = self.verifies = 0

    def propose(self, running) -> None:
        """Set `spec_token_ids` of the running sequences: proposals for those decoding that
        speculate, unless they are more than `disable_by_batch_size` (then speculation costs
        more than it gains); [] for the others."""
        decoding = []
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0:
                decoding.append(seq)
        if len(decoding) > self.cfg.disable_by_batch_size:
            return
        for seq in decoding:
            k = min(self.cfg.num_speculative_tokens,
                    seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)  # fmt: skip
            if k >= 1 and speculates(seq):
                seq.spec_token_ids = self.proposer.propose(seq, k)

    def accept(self, seq: Sequence, logits: torch.Tensor) -> list[tuple[int, TokenLogprobs | None]]:
        """The tokens seq keeps of its proposals' verification step (`verify`), each with its
        logprobs when the request asked for them; counted."""
        draft = seq.spec_token_ids
        tokens = verify(logits, seq, draft)
        self.verifies += 1
        self.proposed += len(draft)
        self.accepted += len(tokens) - 1
        lps: list = [None] * len(tokens)
        if seq.params.logprobs is not None:
            k = [seq.params.logprobs] * len(tokens)
            lps = token_logprobs(logits[: len(tokens)], torch.tensor(tokens), k)
        return list(zip(tokens, lps, strict=True))


def spec_stats(speculator: Speculator | None) -> dict[str, float]:
    """The speculative-decoding fields of `LLMEngine.stats` (zeros without speculation)."""
    proposed, accepted, verifies = (
        (speculator.proposed, speculator.accepted, speculator.verifies) if speculator else (0, 0, 0)
    )
    return {
        "spec_proposed_tokens": proposed,
        "spec_accepted_tokens": accepted,
        "spec_verify_steps": verifies,
        # accepted / proposed; tokens per verification step (accepted + the target's one)
        "spec_acceptance_rate": accepted / max(1, proposed),
        "spec_mean_accepted_len": (accepted + verifies) / max(1, verifies),
    }


def speculates(seq: Sequence) -> bool:
    """Whether seq's tokens may be proposed (see the module's docstring)."""
    return not seq.params.penalized and seq.guide is None


def target_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The target's sampling distribution at each row (R, V) of seq's logits, as `sample`
    draws it (logit bias, temperature, top-k / top-p)."""
    p = seq.params
    logits = apply_logit_bias(logits, [seq] * len(logits))
    rows = [_filter(row / p.temperature, p.top_k, p.top_p) for row in logits]
    return torch.stack(rows).softmax(-1)


def verify(logits: torch.Tensor, seq: Sequence, draft: list[int]) -> list[int]:
    """The tokens to emit from the k+1 rows of logits (float32, row j predicts the token after
    draft[:j]): the accepted drafts, then one token of the target's (greedy: its argmax;
    sampled: the residual's draw, or the bonus token)."""
    if seq.params.greedy:
        target = apply_logit_bias(logits, [seq] * len(logits)).argmax(-1).tolist()
        out = []
        for d, t in zip(draft, target, strict=False):
            if d != t:
                break
            out.append(d)
        return [*out, target[len(out)]]
    if seq.params.seed is not None and seq.generator is None:
        seq.generator = torch.Generator().manual_seed(seq.params.seed)
    probs = target_probs(logits, seq)
    if not torch.isfinite(probs).all():  # degenerate settings: the sampler's argmax fallback
        return [int(logits[0].argmax())]
    u = torch.rand(len(draft), generator=seq.generator).tolist()
    out = []
    for j, d in enumerate(draft):
        if u[j] < float(probs[j, d]):  # accept with min(1, p(d) / q(d)), q(d) = 1
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0  # max(0, p - q) for a point mass q at d
        if float(residual.sum()) <= 0:
            return [*out, d]
        return [*out, int(torch.multinomial(residual, 1, generator=seq.generator))]
    return [*out, int(torch.multinomial(probs[len(draft)], 1, generator=seq.generator))]
