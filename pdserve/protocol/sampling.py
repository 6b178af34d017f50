"""SamplingParams: the one sampling type, from the router's OpenAI mapping
(router/openai_api/plans.py) through the control messages (Admit, Prefill) into the engine's
sampler, and the offline API's `pdserve.SamplingParams`. Validated here, once, when it is made
(also when a worker decodes it off the wire); a bad value raises SamplingError naming the field,
which the router answers with a 400 for that field.

Adding a knob: a field here (with its range check), its OpenAI field and its line in the router's
mapping, and its use in engine/sampler.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.guided import GuideSpec

MAX_LOGPROBS = 20  # top logprobs per token (vLLM's limit; OpenAI's is 5 on completions)
MAX_TEMPERATURE = 2.0  # OpenAI's range; above it the distribution is noise


class SamplingError(ValueError):
    """A sampling parameter out of its range: `param` is the field, `rule` what it must be."""

    def __init__(self, param: str, rule: str):
        super().__init__(f"{param} {rule}")
        self.param, self.rule = param, rule


# A frozen dataclass rather than a msgspec Struct: msgspec encodes and decodes it as a field of
# the messages all the same (calling __post_init__, so a worker validates what it receives), and
# it keeps what offline users rely on: `vars(params)`, `dataclasses.replace`, class defaults.
@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first (engine/stops.py)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (>0 logits) / multiplies: prompt and output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # the chosen token's logprob and this many top ones (0..20)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    guide: GuideSpec | None = None  # the output must match it (engine/guided.py)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        object.__setattr__(self, "logit_bias", bias)
        for param, bad, rule in self._rules():
            if bad:
                raise SamplingError(param, rule)

    def _rules(self):
        """(field, is it out of range, what it must be), in the order they are checked."""
        mt, t, k, s = self.max_tokens, self.temperature, self.top_k, self.seed
        yield "max_tokens", not _is_int(mt), f"must be an integer, got {mt!r}"
        yield "max_tokens", mt <= 0, f"must be >= 1, got {mt}; ask for 1 or more"
        yield (
            "temperature",
            not 0 <= t <= MAX_TEMPERATURE,
            (f"must be >= 0 (0 = greedy) and <= {MAX_TEMPERATURE:g}, got {t}"),
        )
        yield "top_k", not 0 <= k < 2**31, f"must be in [0, 2^31) (0 = off), got {k}"
        yield "top_p", not 0 < self.top_p <= 1, f"must be in (0, 1], got {self.top_p}"
        yield "seed", s is not None and not 0 <= s < 2**63, f"must be in [0, 2^63), got {s}"
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            yield name, not -2 <= v <= 2, f"must be in [-2, 2], got {v}"
        rp = self.repetition_penalty
        yield "repetition_penalty", not 0 < rp <= 2, f"must be in (0, 2] (1 = off), got {rp}"
        for tok, b in self.logit_bias:
            yield "logit_bias", tok < 0, f"keys must be token ids (>= 0), got {tok}"
            yield "logit_bias", not -100 <= b <= 100, f"values must be in [-100, 100], got {b}"
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            bad = n is not None and not 0 <= n <= MAX_LOGPROBS
            yield name, bad, f"must be in [0, {MAX_LOGPROBS}], got {n}"
        for s in self.stop:
            yield "stop", not isinstance(s, str) or not s, f"must be non-empty strings, got {s!r}"
        for t in self.stop_token_ids:
            yield (
                "stop_token_ids",
                not _is_int(t) or t < 0,
                (f"must be non-negative integers, got {t!r}"),
            )

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def greedy(self) -> bool:
        # Below ~1e-5 the scaled logits overflow to inf/NaN; such a temperature is argmax anyway.
        return self.temperature < 1e-5


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
