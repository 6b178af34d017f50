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
        self.decode_step_s = 0.0  # seconds per step that carried decode tokens (0: not yet)

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """One step computed `prefill_tokens` prompt tokens and one token for `decode_seqs`
        decoding sequences in `seconds`. A mixed step counts for both: its prefill rate is
        then a little pessimistic, and its duration is exactly the gap the decoders saw."""
        if seconds <= 0:
            return
        if prefill_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_tok_s = _ewma(self.prefill_tok_s, prefill_tokens / seconds)
        if decode_seqs:
            self.decode_step_s = _ewma(self.decode_step_s, seconds)


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - ALPHA) * old + ALPHA * new
