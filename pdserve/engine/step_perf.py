"""Running estimates of an engine's speed, measured from its own steps.

The router's SLO-aware admission control reads them from each worker's heartbeat: how many
prompt tokens per second this engine prefills, and how long a step takes while it decodes
(what every running stream sees as its time per output token).
"""

from __future__ import annotations

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
