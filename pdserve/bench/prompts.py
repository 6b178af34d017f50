"""Prompt texts for synthetic requests: exactly N tokens when a tokenizer is at hand.

A prompt is N words drawn from a fixed list of common English words, each written with a
leading space. With a byte-level BPE tokenizer (Llama, SmolLM2, Qwen, GPT-2 families) a
space-prefixed common word is one token and words never merge across spaces, so N words are N
tokens. `load_prompt_builder` keeps only the words the tokenizer encodes as one token and checks
the property on a long sample; without a tokenizer (or when the check fails) the lengths are
approximate and the builder says so. Each request gets its own random words (seeded by run seed
and request index) so no two prompts share a prefix that a server could cache.

JSONL prompt files (`--prompts-file`) are read by `load_prompt_file`.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np

from pdserve.bench.workload import LengthDist, RequestSpec, arrival_times

log = logging.getLogger(__name__)

_WORDS = """
the of and to in is was for on are with as at be by this had not but from or have an they which
one you were her all she there would their we him been has when who will more no if out so said
what up its about into than them can only other new some could time these two may then do first
any my now such like our over man me even most made after also did many before must through back
years where much your way well down should because each just those people how too little state
good very make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right used
take three water house small place found part number city light point home left land line sound
""".split()
_CHECK_LENGTH = 512  # words in the sample prompt the tokenizer must encode to exactly this many


class PromptBuilder:
    """Builds the prompt text of a RequestSpec; `exact` says whether lengths are exact."""

    def __init__(self, words: list[str], seed: int, exact: bool, source: str) -> None:
        if not words:
            raise ValueError("a prompt builder needs at least one word")
        self.words = tuple(f" {w}" for w in words)
        self.seed = seed
        self.exact = exact
        self.source = source  # what the lengths are counted with, for the report

    def build(self, spec: RequestSpec) -> str:
        """`spec.prompt_tokens` words, the same for the same (seed, index). Multi-turn requests
        ("turn" class) share their session's history and every session's system prompt."""
        if spec.klass == "turn":
            return self._turn(spec)
        rng = np.random.default_rng([self.seed, 2, spec.index])
        picks = rng.integers(len(self.words), size=spec.prompt_tokens)
        return "".join(self.words[i] for i in picks)

    def _words(self, key: list[int], n: int) -> str:
        picks = np.random.default_rng([self.seed, *key]).integers(len(self.words), size=n)
        return "".join(self.words[i] for i in picks)

    def _turn(self, spec: RequestSpec) -> str:
        from pdserve.bench import workload as w

        sessions = w.MT_SESSIONS
        session, turn, _ = w.multiturn_lengths(spec.index, sessions)
        parts = [self._words([3], w.MT_SYSTEM)]
        for k in range(turn + 1):
            parts.append(self._words([4, session, k], w.MT_USER))
            if k < turn:  # the previous answers, as the client would resend them
                parts.append(self._words([5, session, k], w.MT_ANSWER))
        return "".join(parts)


def approximate_builder(seed: int) -> PromptBuilder:
    """One word per token, roughly right for any English BPE tokenizer."""
    return PromptBuilder(_WORDS, seed, exact=False, source="approximate (1 word ~ 1 token)")


def exact_builder(tokenizer, seed: int, source: str) -> PromptBuilder:
    """Words that `tokenizer` encodes as single tokens; falls back to approximate if unsure."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    words = [w for w in _WORDS if len(encode(f" {w}")) == 1]
    builder = PromptBuilder(words or _WORDS, seed, exact=bool(words), source=source)
    sample = builder.build(RequestSpec(0, 0.0, "check", _CHECK_LENGTH, 1))
    if not words or len(encode(sample)) != _CHECK_LENGTH:
        log.warning(
            "tokenizer %s does not give one token per word: prompt lengths are approximate", source
        )
        return approximate_builder(seed)
    return builder


def load_prompt_builder(tokenizer: str | None, seed: int) -> PromptBuilder:
    """A builder for `tokenizer`: a GGUF file or HF folder, "bundled", or "none" (approximate).

    The tokenizer is loaded with `pdserve.model.loader.load_tokenizer`, imported lazily so the
    load generator works where the engine is not installed; any failure there falls back to
    approximate lengths with a warning rather than stopping the benchmark.
    """
    if tokenizer in (None, "none"):
        return approximate_builder(seed)
    try:
        from pdserve.model.loader import load_tokenizer

        loaded = load_tokenizer(None if tokenizer == "bundled" else tokenizer)
    except Exception as exc:  # noqa: BLE001 - any failure means "no tokenizer", said below
        log.warning("no tokenizer (%s: %s): prompt lengths are approximate", tokenizer, exc)
        return approximate_builder(seed)
    return exact_builder(loaded, seed, source=f"exact (tokenizer: {tokenizer})")


class FilePrompt(NamedTuple):
    """One line of a JSONL prompt file."""

    prompt: str
    output_tokens: int | None
    klass: str


def load_prompt_file(path: str | Path) -> list[FilePrompt]:
    """Read JSONL lines ``{"prompt": str, "output_tokens"?: int, "class"?: str}``.

    ``max_tokens`` is accepted for ``output_tokens``. Raises ValueError naming the bad line.
    """
    prompts = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompt = item["prompt"]
            output = item.get("output_tokens", item.get("max_tokens"))
            if not isinstance(prompt, str) or not (output is None or int(output) >= 1):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(
                f'{path}:{number}: expected a JSON object with a string "prompt" and an '
                f'optional positive "output_tokens", got {line[:80]!r}'
            ) from None
        out = None if output is None else int(output)
        prompts.append(FilePrompt(prompt, out, str(item.get("class", "file"))))
    if not prompts:
        raise ValueError(f"{path}: no prompts in the file (one JSON object per line)")
    return prompts


class FilePromptBuilder:
    """Serves the prompts of a JSONL file in order (cycling); lengths come from `usage`."""

    exact = False

    def __init__(self, prompts: list[FilePrompt], source: str) -> None:
        self.prompts = prompts
        self.source = source

    def build(self, spec: RequestSpec) -> str:
        return self.prompts[spec.index % len(self.prompts)].prompt


def file_requests(
    prompts: list[FilePrompt],
    output: LengthDist,
    n: int,
    seed: int,
    arrival: str = "poisson",
    rate: float = math.inf,
    burstiness: float = 1.0,
) -> list[RequestSpec]:
    """`n` requests cycling through `prompts`, with arrivals as in `arrival_times`.

    A line's own ``output_tokens`` wins over `output`; prompt_tokens is a word count estimate
    (the report uses the server's `usage` count when it sends one).
    """
    times = arrival_times(arrival, rate, n, seed, burstiness)
    drawn = output.sample(np.random.default_rng([seed, 1]), n)
    specs = []
    for i in range(n):
        item = prompts[i % len(prompts)]
        out = item.output_tokens or int(drawn[i])
        specs.append(RequestSpec(i, float(times[i]), item.klass, len(item.prompt.split()), out))
    return specs
