"""Running estimates of an engine's speed, measured from its own steps.

The router's SLO-aware admission control reads them from each worker's heartbeat: how many
prompt tokens per second this engine prefills, and how long a step takes while it decodes
(what every running stream sees as its time per output token).

`StepLog` keeps every step instead, for the simulator: with `PDSERVE_STEP_LOG=DIR` (or
`pdserve serve --step-log DIR`) each engine appends one JSON line per step to
DIR/steps-ROLE-PID.jsonl: when it started (`t`, Unix seconds), how long it took (`s`) and what
it computed, in the simulator's terms (`pdserve.sim.latency.Batch`): new tokens, sampled
sequences, causal query-key pairs, cached tokens read, sequences, and the prompt tokens among
the new ones. `pdserve profile --from-steps DIR` fits the latency model to them: the engine's
speed as served, with whatever else shared its cores at the time.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.sequence import ScheduledBatch

ALPHA = 0.2  # weight of the newest step in the moving averages
MIN_PREFILL_TOKENS = 16  # steps with fewer prompt tokens say little about prefill speed


class StepPerf:
    def __init__(self) -> None:
        self.prefill_tok_s = 0.0  # prompt tokens per second of step time (0: not measured yet)
        self.decode_step_s = 0.0  # seconds between decode tokens, as streams see them (0: not yet)
        self._last_decode_end: float | None = None  # end of the previous step, if it decoded

    def observe(self, prefill_tokens: int, decode_seqs: int, start: float, end: float) -> None:
        """One step, from `start` to `end` (time.perf_counter), computed `prefill_tokens`
        prompt tokens and one token for each of `decode_seqs` decoding sequences.

        Prefill speed counts the step alone (a mixed step makes it a little pessimistic).
        The decode figure is the time from the previous decode step's end to this one's: what
        a running stream waits per token, including whatever the worker did between steps
        (receiving KV, messages). After a step without decodes, only this step counts."""
        if end <= start:
            return
        if prefill_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_tok_s = _ewma(self.prefill_tok_s, prefill_tokens / (end - start))
        if decode_seqs:
            since = start if self._last_decode_end is None else self._last_decode_end
            self.decode_step_s = _ewma(self.decode_step_s, end - since)
        self._last_decode_end = end if decode_seqs else None


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - ALPHA) * old + ALPHA * new


class StepLog:
    """Appends one JSON line per engine step to `path` (line-buffered: a killed worker loses
    at most the step it was in)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    @classmethod
    def for_engine(cls, directory: Path | None, role: str) -> StepLog | None:
        """The log of this process's engine under `directory`, or None when not logging."""
        if directory is None:
            return None
        return cls(directory / f"steps-{role}-{os.getpid()}.jsonl")

    def write(
        self, start: float, seconds: float, new_tokens: list[int], computed: list[int],
        prefill_tokens: int, sampled: int,
    ) -> None:  # fmt: skip
        """One step that began `seconds` ago at perf_counter `start`: per sequence, the tokens
        it computed and the tokens it had computed before."""
        pairs = sum(n * (c + n / 2) for n, c in zip(new_tokens, computed, strict=True))
        record = {
            "t": round(time.time() - seconds, 6),
            "s": round(seconds, 7),
            "tokens": sum(new_tokens),
            "sampled": sampled,
            "pairs": pairs,
            "kv_read": sum(computed),
            "seqs": len(new_tokens),
            "prefill_tokens": prefill_tokens,
        }
        self._file.write(json.dumps(record) + "\n")


def phase_counts(batch: ScheduledBatch) -> tuple[int, int]:
    """(prompt tokens computed, sequences decoding) in a scheduled step, before it advances:
    what `StepPerf.observe` takes."""
    prefill_tokens = decodes = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            prefill_tokens += n
        else:
            decodes += 1
    return prefill_tokens, decodes
