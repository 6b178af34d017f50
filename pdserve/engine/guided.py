"""Structured output: grammar-constrained decoding with llguidance.

A request's `GuideSpec` (any JSON object, a JSON schema, a regex or a Lark grammar) travels in
the control messages. The router calls `check_spec` and answers 400 before anything is
scheduled; a worker builds one `GuideCompiler` per process (its tokenizer.json, the logits'
vocabulary size, the EOS ids) and one `Guide` per guided sequence (`compiler.guide(spec,
prefix)`: `prefix` replays tokens already generated, e.g. when a request moves to another
worker, or the first token a prefill worker sampled).

One decode step of the engine, for the guided sequences of a batch:

1. After sampling step t: `guide.accept(token)` for each guided sequence (an EOS token is not
   accepted: it finishes the sequence). When `guide.is_finished`, finish the sequence now
   (reason "stop"): only EOS could follow, so sampling it would waste a step.
2. Before step t+1's forward pass, start `compiler.fill_bitmask(guides, bitmask)` on a thread
   (rows in batch order; `None` for an unguided row). llguidance computes the masks in Rust
   on its own thread pool and releases the GIL, so the fill overlaps the forward pass. No
   guide in the batch may be touched (accept) while the fill runs.
3. Join the thread, `apply_bitmask(logits, bitmask)` (disallowed -> -inf; the mask is copied
   to the logits' device), then sample as usual (penalties and temperature after the mask).

`bitmask`: `compiler.allocate_bitmask(max_batch)`, one int32 word per 32 token ids.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance as llg
import msgspec

if TYPE_CHECKING:
    import torch

# Compact JSON (no free whitespace) so small models do not ramble; a schema's own x-guidance wins.
JSON_OPTIONS = {"whitespace_flexible": False}
GRAMMAR_CACHE = 512  # compiled grammars kept, per process (check_spec) and per compiler
_LIMITS = llg.LLParserLimits(verbose_errors=False)  # error messages go to clients: keep them short


class GuideSpec(msgspec.Struct, frozen=True):
    """What the output must match. `spec`: the JSON schema as a JSON string, the regex, or the
    Lark grammar (llguidance's dialect); empty for json_object."""

    kind: str
    spec: str = ""


class GuideError(ValueError):
    """A spec that does not compile, or a token the guide does not allow."""


def check_spec(spec: GuideSpec) -> None:
    """Raise ValueError saying what to fix when `spec` cannot compile. Cached: cheap per request."""
    _grammar(spec)


def _checked(grammar: str, what: str, fix: str) -> str:
    """`grammar` if llguidance can build it, else GuideError "<what>: <its error>; <fix>"."""
    if error := llg.LLMatcher.validate_grammar(grammar, limits=_LIMITS):
        lines = error.strip().splitlines()  # a regex error comes with a drawing: keep its line
        brief = next((x[len("error: ") :] for x in lines if x.startswith("error: ")), lines[0])
        raise GuideError(f"{what}: {brief}; {fix}")
    return grammar


def _object_grammar(text: str) -> str:
    if text:
        raise GuideError("json_object takes no spec: use json_schema to give a schema")
    return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)


def _schema_grammar(text: str) -> str:
    import jsonschema  # a few ms, only when a schema is checked

    field = "response_format.json_schema.schema"
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GuideError(f"{field} is not valid JSON: {e}; send the schema as an object") from None
    if not isinstance(schema, dict):
        raise GuideError(f"{field} must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise GuideError(
            f"{field} is not a valid JSON schema: {e.message} at {e.json_path}; fix the schema"
        ) from None
    return _checked(
        llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS),
        f"{field} cannot be enforced",
        "keep to the JSON schema subset structured output supports (llguidance's docs)",
    )


_BUILDERS: dict[str, Callable[[str], str]] = {  # kind -> spec -> llguidance's grammar
    "json_object": _object_grammar,
    "json_schema": _schema_grammar,
    "regex": lambda text: _checked(
        llg.LLMatcher.grammar_from_regex(text),
        "the regex is not valid",
        "fix the regex (Rust regex syntax: no look-around, no backreferences)",
    ),
    "grammar": lambda text: _checked(
        text, "the Lark grammar is not valid", "fix it (llguidance's Lark; `start` is the top rule)"
    ),
}


@functools.lru_cache(maxsize=GRAMMAR_CACHE)
def _grammar(spec: GuideSpec) -> str:
    """llguidance's grammar for `spec`, validated; GuideError (a ValueError) if it is not."""
    if spec.kind not in _BUILDERS:
        raise GuideError(f"unknown guide kind {spec.kind!r}: use one of {', '.join(_BUILDERS)}")
    return _BUILDERS[spec.kind](spec.spec)


class Guide:
    """One sequence's matcher. Not thread-safe: one step at a time (see the module docstring)."""

    def __init__(self, compiler: GuideCompiler, matcher: llg.LLMatcher) -> None:
        self._compiler = compiler
        self._matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance over `token_id`. GuideError if it was not allowed: the guide is then dead
        (`error` says why) and its mask allows only EOS."""
        if not self._matcher.consume_token(token_id):
            raise GuideError(f"token {token_id} is not allowed: {self.error}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from here, the grammar allows (nothing is consumed)."""
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    @property
    def is_finished(self) -> bool:
        """The output matches the whole grammar and nothing may follow but EOS."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        """Why the guide stopped working (a rejected token), or None."""
        return self._matcher.get_error().split("\n")[0] if self._matcher.is_error() else None

    def allowed(self) -> torch.Tensor:
        """(V,) bool: the tokens allowed next. For tests and one-offs; batches use fill_bitmask."""
        bitmask = self._compiler.allocate_bitmask(1)
        self._compiler.fill_bitmask([self], bitmask)
        return unpack_bitmask(bitmask, self._compiler.vocab_size)[0]


class GuideCompiler:
    """Builds guides for one tokenizer; one per process (building it takes ~0.2 s)."""

    def __init__(
        self,
        tokenizer_file: Path,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        num_threads: int | None = None,
    ) -> None:
        """`vocab_size`: the width of the model's logits (may exceed the tokenizer's; those
        ids are never allowed). `num_threads`: llguidance's pool (None: 80 % of the CPUs)."""
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # tokenizer.json's text, as HF `tokenizers` writes it: no transformers needed
        self._tokenizer = llg.LLTokenizer(
            Path(tokenizer_file).read_text(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self._executor = llg.LLExecutor(num_threads)
        self._fresh: OrderedDict[GuideSpec, llg.LLMatcher] = OrderedDict()  # LRU, never advanced

    @property
    def words(self) -> int:
        """int32 words in one bitmask row."""
        return (self.vocab_size + 31) // 32

    def guide(self, spec: GuideSpec, prefix: Sequence[int] = ()) -> Guide:
        """A guide at the start of `spec`, advanced over `prefix` (tokens already generated).
        GuideError if the spec does not compile or the prefix does not match it."""
        fresh = self._fresh.get(spec)
        if fresh is None:
            fresh = llg.LLMatcher(self._tokenizer, _grammar(spec), log_level=0, limits=_LIMITS)
            if fresh.is_error():
                error = fresh.get_error().split("\n")[0]
                raise GuideError(f"the {spec.kind} spec does not compile: {error}")
            self._fresh[spec] = fresh
            if len(self._fresh) > GRAMMAR_CACHE:
                self._fresh.popitem(last=False)
        self._fresh.move_to_end(spec)
        guide = Guide(self, fresh.deep_copy())  # a copy is ~100x cheaper than a new matcher
        for i, token in enumerate(prefix):
            try:
                guide.accept(token)
            except GuideError as e:
                raise GuideError(f"replayed token {i} of {len(prefix)}: {e}") from None
        return guide

    def allocate_bitmask(self, batch: int) -> torch.Tensor:
        """(batch, words) int32, all allowed; pinned when CUDA is there (a non-blocking copy)."""
        import torch

        pin = torch.cuda.is_available()
        return torch.full((batch, self.words), -1, dtype=torch.int32, pin_memory=pin)

    def fill_bitmask(
        self,
        guides: Sequence[Guide | None],
        bitmask: torch.Tensor,
        drafts: Sequence[tuple[Guide, int, list[int]]] = (),
    ) -> None:
        """Row i <- the tokens guides[i] allows next (all tokens for None); for each
        (guide, row, draft) of `drafts` (speculative decoding's proposals), rows row .. row +
        len(draft) <- what the guide allows after draft[:j] (the draft must be allowed: see
        `valid_prefix`; the guide itself does not move). Releases the GIL while llguidance
        computes the rows in parallel: run it on a thread beside the forward pass. `bitmask`:
        a CPU, contiguous int32 tensor (words wide, a row for each of those)."""
        import torch

        rows, words = bitmask.shape
        need = max([len(guides), *(r + len(d) + 1 for _, r, d in drafts)])
        ok = bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and words == self.words
        if not (ok and bitmask.is_contiguous() and rows >= need):
            shape = f"(>= {need}, {self.words})"
            raise ValueError(f"bitmask must be a contiguous CPU int32 tensor of shape {shape}")
        matchers = [(g._matcher, i) for i, g in enumerate(guides) if g is not None]
        with_drafts = [(g._matcher, r, list(d)) for g, r, d in drafts if d]
        matchers += [(g._matcher, r) for g, r, d in drafts if not d]
        for i, g in enumerate(guides):
            if g is None:
                bitmask[i] = -1
        # What llguidance.torch.fill_next_token_bitmask_par does, without importing dynamo. One
        # call: the GIL is released once (a call per row would wait to get it back each time);
        # two with drafts (llguidance's call for them takes no empty draft).
        if matchers:
            self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, rows)
        if with_drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                with_drafts, bitmask.data_ptr(), words * 4, rows
            )


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(N, words) int32 -> (N, vocab_size) bool, on the bitmask's device."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (N, words, 32), bit j of word w = token 32w+j
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: logits (N, V) <- -inf where `bitmask` (N rows, copied to the logits' device)
    disallows the token. Eager torch: llguidance.torch's kernel needs torch.compile (seconds
    on first use and 1.9 s to import dynamo)."""
    n, vocab = logits.shape
    mask = bitmask[:n].to(logits.device, non_blocking=True)
    logits.masked_fill_(~unpack_bitmask(mask, vocab), float("-inf"))
