"""Speculative decoding: a proposer guesses the next k tokens of a decoding sequence, one step
of the target model scores all k+1 positions, and the longest prefix the target agrees with is
kept (plus one token of the target's own), so an accepted guess is a token without a step.

`--speculative-config` takes vLLM's JSON fields (method, num_speculative_tokens,
prompt_lookup_min/max, model, disable_by_batch_size). Proposers are a registry (`PROPOSERS`):
`ngram` (prompt lookup, as vLLM's NgramProposer) and `draft` (a smaller model of the same
vocabulary, `model`: its GGUF file or HF folder, run by the same worker with a KV cache of its
own, proposing its greedy tokens). Verification (`verify`):
greedy keeps the longest prefix equal to the target's argmax; sampling is rejection sampling
(Leviathan et al., vLLM's RejectionSampler): a draft token d with draft probability q(d) is
accepted with min(1, p(d)/q(d)); the first rejected position samples from the residual
max(0, p - q) normalized; if every draft is accepted a bonus token is sampled from p at the
last position. Both proposers propose deterministically (prompt lookup; the draft model's
argmax), so q is a point mass at d: acceptance is p(d) and the residual is p with d removed.
The output's distribution is the target's.

Every row is scored as the sampler would score it there: penalties count the proposals before
the row as output already emitted (`_Row`), then the logit bias; a guided sequence's
proposals are cut at the first token its grammar refuses (`Speculator.propose`), and each row
gets the grammar's mask after the proposals before it (`EngineGuides.start_masks`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

import torch

from pdserve.engine.sampler import (
    TokenLogprobs,
    argmax_rows,
    draw_from,
    filtered_probs,
    generator_of,
    process,
    token_logprobs,
    uniform,
)
from pdserve.engine.sequence import Sequence
from pdserve.model.quant import quantized_linears

# Above this many decoding sequences in a step, verification costs more than it gains:
# benchmarks/spec_decode.py --concurrency 2 4 8 with no limit (Zen 5, 2 cores, int4) gave
# rewrite / quote / free chat 0.89-1.04x / 1.10-1.15x / 0.91x at 2 sequences, 0.92-0.99x /
# 0.88-1.02x / 0.84-0.88x at 4, 0.68-0.91x at 8 (docs/serving.md); with the bf16 verify
# attention (2026-12-05) 1.29x / 1.30x / 0.97x at 2, 0.85x / 1.12x / 0.90x at 4.
# `disable_by_batch_size` overrides it; a step also keeps within `row_budget` (measured per
# machine) whatever it is.
DEFAULT_DISABLE_BY_BATCH_SIZE = 2
# The i-th proposal is made while its chance of acceptance, r^i for a per-proposal acceptance
# r, stays above ROW_COST. One more verified row costs ~0.2-0.25 of a plain step with the
# few-row kernels (Zen 5, 2 threads), but acceptance comes in bursts (a copy runs, then
# diverges): benchmarks/spec_decode.py at c=1 gave rewrite / free chat 1.30x / 1.03x at 0.25,
# 1.41x / 0.98x at 0.15.
# There is no backing off after misses (a sequence whose proposals all fail still proposes
# one token where its n-gram matches): sitting out min(2^m, 16) steps after m misses gave
# rewrite / quote / free chat 1.37x / 1.37x / 1.03x, none 1.41x / 1.48x / 0.99x (c=1, 3 rounds).
ROW_COST = 0.15
DECAY = 0.7  # of a sequence's acceptance counts per verify step: recent proposals weigh most


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

    def __init__(self, cfg: SpeculativeConfig, vocab_size: int, engine=None):
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
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(self.min_n, self.max_n)
        return seq.ngrams.propose(seq.token_ids, k)


class NgramIndex:
    """A sequence's n-grams (min_n .. max_n long) that have a token after them, each with
    where it first starts; grown by the tokens appended since the last call, so a step costs
    a few dictionary operations, not a scan of the whole context (the scan took ~0.3 ms of a
    ~5 ms step at 700 tokens)."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(min_n, max_n + 1)
        self.first: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.length = 0  # the tokens indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the earliest occurrence of the longest n-gram ending `tokens`
        that also occurs earlier in them."""
        n_tok = len(tokens)
        for n in self.sizes:  # windows [i, i + n) with a token after them: i + n <= n_tok - 1
            first = self.first[n]
            for i in range(max(0, self.length - n), n_tok - n):
                first.setdefault(tuple(tokens[i : i + n]), i)
        self.length = n_tok
        for n in reversed(self.sizes):
            if n < n_tok:
                i = self.first[n].get(tuple(tokens[n_tok - n :]))
                if i is not None:
                    return tokens[i + n : i + n + k]
        return []


class DraftModelProposer:
    """`draft`: a smaller model of the target's vocabulary (`model`), with a KV cache of its
    own (DRAFT_KV_SHARE of the target's bytes) and one draft sequence per speculating request,
    kept between steps: a proposal computes only what the draft has not seen of the target's
    tokens (its tokens past the longest common prefix are recomputed: that is the rollback of
    rejected proposals), then its k greedy tokens, one single-token step each. A request's
    draft blocks are freed at the first proposal round it is no longer running in."""

    def __init__(self, cfg: SpeculativeConfig, vocab_size: int, engine=None):
        import dataclasses

        from pdserve.engine.block_manager import BlockManager
        from pdserve.engine.model_runner import ModelRunner
        from pdserve.model.loader import load_model_files

        files = load_model_files(cfg.model)
        if files.config.vocab_size != vocab_size:
            raise ValueError(
                f"--speculative-config: the draft model {cfg.model} has a vocabulary of "
                f"{files.config.vocab_size} tokens, the target {vocab_size}; a draft must share "
                "the target's tokenizer"
            )
        target = engine.config
        kv_gb = DRAFT_KV_SHARE * engine.runner.num_blocks * engine.runner.block_bytes / (1 << 30)
        config = dataclasses.replace(
            target, model=cfg.model, kv_cache_gb=kv_gb, speculative_config=None,
            tensor_parallel_size=1, expert_parallel_size=1, enable_prefix_caching=False,
        )  # fmt: skip
        self.runner = ModelRunner(config, files, engine.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, False)
        self.drafts: dict[str, Sequence] = {}

    @staticmethod
    def check(cfg: SpeculativeConfig) -> None:
        if not cfg.model:
            raise ValueError(
                "--speculative-config: method 'draft' needs 'model', the draft's GGUF file "
                "or Hugging Face folder"
            )
        if cfg.prompt_lookup_min is not None or cfg.prompt_lookup_max is not None:
            raise ValueError("--speculative-config: prompt_lookup_min/max are for 'ngram' only")
        from pdserve.model.loader import load_model_config

        try:  # a missing path or an unknown architecture, by name, before any model loads
            load_model_config(cfg.model)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--speculative-config: the draft model: {exc}") from None

    def retain(self, running) -> None:
        """Free the drafts of requests that are no longer running."""
        live = {seq.request_id for seq in running}
        for rid in [r for r in self.drafts if r not in live]:
            self.blocks.free(self.drafts.pop(rid))

    def propose(self, seq: Sequence, k: int) -> list[int]:
        from pdserve.engine.sampling_params import SamplingParams
        from pdserve.engine.sequence import ScheduledBatch

        tokens = seq.token_ids
        draft = self.drafts.get(seq.request_id)
        if draft is None:
            draft = Sequence(seq.request_id, list(tokens), SamplingParams(max_tokens=1))
            self.drafts[seq.request_id] = draft
        else:
            same = 0
            limit = min(draft.num_computed_tokens, len(tokens))
            while same < limit and draft.token_ids[same] == tokens[same]:
                same += 1
            draft.num_computed_tokens = same
            draft.token_ids = list(tokens)
        if not self.blocks.append_slots(draft, len(tokens) + k - 1):
            return []  # the draft's cache is full: this request does not speculate this step
        out = []
        for _ in range(k):
            n = draft.num_tokens - draft.num_computed_tokens
            _, logits = self.runner.run(ScheduledBatch([draft], [n]))
            draft.num_computed_tokens += n
            out.append(int(logits[-1].argmax()))
            draft.token_ids.append(out[-1])
        return out


DRAFT_KV_SHARE = 0.25  # of the target's KV cache bytes: a draft is smaller and its sequences few
PROPOSERS = {"ngram": NgramProposer, "draft": DraftModelProposer}


def make_proposer(cfg: SpeculativeConfig, vocab_size: int, engine=None):
    return PROPOSERS[cfg.method](cfg, vocab_size, engine)


class Speculator:
    """The engine's side of speculative decoding: proposals for the decoding sequences before a
    step is scheduled (`propose`), the tokens each keeps after it (`accept`), and the counters
    `LLMEngine.stats` reports. How many tokens a sequence proposes follows its recent acceptance
    (`proposal_length`): a copy runs at num_speculative_tokens, a sequence whose guesses often
    fail proposes one or two. Both depend only on the past, so sampled outputs keep the
    target's distribution."""

    def __init__(
        self, cfg: SpeculativeConfig, vocab_size: int, max_model_len: int, engine=None
    ) -> None:
        """`engine`: the target's LLMEngine (a draft model takes its config and a share of its
        KV cache)."""
        self.cfg = cfg
        self.proposer = make_proposer(cfg, vocab_size, engine)
        self.max_model_len = max_model_len
        self.row_budget = row_budget(engine.runner.model) if engine is not None else None
        self.proposed = self.accepted = self.verifies = 0

    def propose(self, running) -> None:
        """Set `spec_token_ids` of the running sequences: proposals for those decoding that
        speculate, unless they are more than `disable_by_batch_size` (then speculation costs
        more than it gains), and only as many as keep the step within `row_budget` rows (the
        earlier sequences first); [] for the others."""
        decoding = []
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0:
                decoding.append(seq)
        if hasattr(self.proposer, "retain"):
            self.proposer.retain(running)
        if len(decoding) > self.cfg.disable_by_batch_size:
            return
        spare = None if self.row_budget is None else self.row_budget - len(decoding)
        for seq in decoding:
            k = min(proposal_length(seq, self.cfg.num_speculative_tokens),
                    seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)  # fmt: skip
            if spare is not None:
                k = min(k, spare)
            if k >= 1:
                draft = self.proposer.propose(seq, k)
                if seq.guide is not None:  # up to the first token its grammar refuses
                    del draft[seq.guide.valid_prefix(draft) :]
                seq.spec_token_ids = draft
                if spare is not None:
                    spare -= len(draft)

    def accept(
        self, seq: Sequence, logits: torch.Tensor, mask: torch.Tensor | None = None
    ) -> list[tuple[int, TokenLogprobs | None]]:
        """The tokens seq keeps of its proposals' verification step (`verify`; `mask`: its
        grammar's bitmask rows), each with its logprobs (of the raw logits, as `sample`
        gives them) when the request asked for them; counted."""
        draft = seq.spec_token_ids
        tokens = verify(logits, seq, draft, mask)
        self.verifies += 1
        self.proposed += len(draft)
        self.accepted += len(tokens) - 1
        if draft:  # a try ends at the first rejection, or after the last proposal
            hits = len(tokens) - 1
            seq.spec_hits = DECAY * seq.spec_hits + hits
            seq.spec_tries = DECAY * seq.spec_tries + hits + (hits < len(draft))
        lps: list = [None] * len(tokens)
        if seq.params.logprobs is not None:
            k = [seq.params.logprobs] * len(tokens)
            lps = token_logprobs(logits[: len(tokens)], torch.tensor(tokens), k)
        return list(zip(tokens, lps, strict=True))


def row_budget(model) -> int | None:
    """The most rows a speculating step's decodes may hold: the fewest up to which one of the
    model's quantized linears runs its few-row kernel (`model/kernel_rows.py`: measured per
    machine and shape, cached). Beyond it that linear switches to the dense GEMM: the step is
    no longer bound by reading the weights, so verified rows stop being nearly free, and its
    rows round differently from a plain step's (greedy tokens would differ from plain
    decoding's). None for a dense model (no kernel to leave)."""
    rows = [linear.max_rows for linear in quantized_linears(model) if linear.max_rows > 0]
    return min(rows) if rows else None


def proposal_length(seq: Sequence, most: int) -> int:
    """How many tokens to propose for seq, 1 to `most`: the largest i whose chance of
    acceptance r^i stays above ROW_COST, for r its recent per-proposal acceptance."""
    r = seq.spec_hits / seq.spec_tries
    if r <= ROW_COST:
        return 1
    if r >= 0.99:
        return most
    return max(1, min(most, int(math.log(ROW_COST) / math.log(r))))


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


class _Row:
    """seq as the sampler sees it at verify row j: its first j proposals already emitted
    (what the penalties count)."""

    def __init__(self, seq: Sequence, emitted: list[int]):
        self.params, self.prompt_token_ids = seq.params, seq.prompt_token_ids
        self.generated_token_ids = seq.generated_token_ids + emitted


def processed_logits(
    logits: torch.Tensor, seq: Sequence, draft: list[int], mask: torch.Tensor | None = None
) -> torch.Tensor:
    """seq's k+1 rows of logits as `sample` processes a row before drawing: penalties (row j
    counting draft[:j] as output), logit bias, the grammar's mask. A new tensor when any
    applies (the raw logits give the logprobs)."""
    rows = [_Row(seq, draft[:j]) for j in range(len(logits))] if seq.params.penalized else None
    return process(logits, rows or [seq] * len(logits), mask)


def target_probs(processed: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The target's sampling distribution at each row (R, V) of seq's processed logits, as
    `sample` draws it (temperature, top-k / top-p)."""
    return filtered_probs(processed, [seq.params] * len(processed))


def verify(
    logits: torch.Tensor, seq: Sequence, draft: list[int], mask: torch.Tensor | None = None
) -> list[int]:
    """The tokens to emit from the k+1 rows of logits (float32, row j predicts the token after
    draft[:j]; `mask`: the grammar's rows): the accepted drafts, then one token of the
    target's (greedy: its argmax; sampled: the residual's draw, or the bonus token)."""
    logits = processed_logits(logits, seq, draft, mask)
    if seq.params.greedy:
        target = argmax_rows(logits)
        out = []
        for d, t in zip(draft, target, strict=False):
            if d != t:
                break
            out.append(d)
        return [*out, target[len(out)]]
    probs = target_probs(logits, seq)
    if not torch.isfinite(probs.sum(-1)).all():  # degenerate settings (a NaN row): argmax
        return [int(logits[0].argmax())]
    u = torch.rand(len(draft), generator=generator_of(seq)).tolist()
    out = []
    for j, d in enumerate(draft):
        if u[j] < float(probs[j, d]):  # accept with min(1, p(d) / q(d)), q(d) = 1
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0  # max(0, p - q) for a point mass q at d
        if float(residual.sum()) <= 0:
            return [*out, d]
        return [*out, draw_from(residual, uniform(seq))]
    return [*out, draw_from(probs[len(draft)], uniform(seq))]
