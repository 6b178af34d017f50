"""An engine's structured outputs: steps 1 and 2 of `engine/guided.py` for its batches.

`EngineGuides` makes the `GuideCompiler` on first use (~0.2 s: only engines that get a guided
request pay it), starts each step's masks on a thread of its own while the model runs
(`start_masks`), and advances a guided sequence over its sampled token (`finishes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.engine.guided import Guide, GuideCompiler, GuideError, GuideSpec

log = logging.getLogger("pdserve.engine.llm_engine")  # the engine's, as its records were


class EngineGuides:
    """The guides of one engine. `tokenizer_file()`: its tokenizer.json (raises ValueError
    when the engine has none), called once, on the first guided request."""

    def __init__(
        self, tokenizer_file: Callable[[], str], vocab_size: int, eos_ids: Sequence[int]
    ) -> None:
        self._tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_ids = set(eos_ids)
        self._compiler: GuideCompiler | None = None
        self._masker: ThreadPoolExecutor | None = None  # fills guides' masks beside the model

    @property
    def compiler(self) -> GuideCompiler:
        if self._compiler is None:
            self._compiler = GuideCompiler(
                self._tokenizer_file(), self.vocab_size, sorted(self.eos_ids)
            )
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="guide-mask")
        return self._compiler

    def guide(self, spec: GuideSpec, prefix: Sequence[int]) -> Guide:
        """A guide for `spec` advanced over `prefix` (output tokens replayed in the prompt)."""
        return self.compiler.guide(spec, prefix)

    def start_masks(self, seqs, num_new_tokens: Sequence[int]) -> Future | None:
        """Guided sequences that sample this step: their next-token masks, computed on a
        thread while the model runs (llguidance releases the GIL). A future of (bitmask,
        verify rows): row i of the bitmask is seqs[i]'s mask (rows of unguided sequences
        allow everything); a guided sequence verifying proposals has 1 + k rows from
        verify_rows[i] on, row j what it allows after its first j proposals. None without
        a guided sequence."""
        if not any(s.guide is not None for s in seqs):
            return None
        guides = [
            s.guide if s.num_computed_tokens + n == s.num_tokens else None
            for s, n in zip(seqs, num_new_tokens, strict=True)
        ]
        starts, drafts, rows = {}, [], len(seqs)
        for i, s in enumerate(seqs):
            if s.guide is not None and s.spec_token_ids:
                starts[i] = rows
                drafts.append((s.guide, rows, list(s.spec_token_ids)))
                rows += 1 + len(s.spec_token_ids)
        bitmask = self.compiler.allocate_bitmask(rows)

        def fill():
            self.compiler.fill_bitmask(guides, bitmask, drafts)
            return bitmask, starts

        return self._masker.submit(fill)

    def finishes(self, seq, token: int) -> bool:
        """Advance guided `seq` over its sampled `token`: whether that ends it (EOS, which the
        grammar allows only at its end; the grammar complete; a token it refused)."""
        if token in self.eos_ids:  # (ignore_eos) the grammar allows EOS only at its end
            return True
        try:
            seq.guide.accept(token)
        except GuideError as exc:  # the mask allowed it: a bug, not the client's fault
            log.error("request %s left its grammar: %s", seq.request_id, exc)
            return True
        return seq.guide.is_finished  # nothing but EOS may follow
