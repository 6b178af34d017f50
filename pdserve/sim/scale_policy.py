"""The autoscaler's settings (`pdserve serve --autoscale` flags take their defaults from them):
the pool sizes it stays within and how often and how cautiously it decides. Cheap to import
(no numpy): the flag table of `launch/cli.py` reads the defaults here; the policy itself is
`sim/autoscale.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.bench.metrics import SLO


@dataclass(frozen=True)
class ScaleBounds:
    """Pool sizes the autoscaler stays within (`--prefill/--decode` .. `--max-*`)."""

    min_prefill: int = 1
    max_prefill: int = 1
    min_decode: int = 1
    max_decode: int = 1

    def __post_init__(self) -> None:
        if self.min_prefill < 0 or self.min_decode < 1:
            raise ValueError("autoscaling needs --prefill >= 0 and --decode >= 1 workers")
        if self.max_prefill < self.min_prefill:
            raise ValueError(f"--max-prefill ({self.max_prefill}) must be >= --prefill "
                             f"({self.min_prefill})")  # fmt: skip
        if self.max_decode < self.min_decode:
            raise ValueError(f"--max-decode ({self.max_decode}) must be >= --decode "
                             f"({self.min_decode})")  # fmt: skip

    def clamp(self, prefill: int, decode: int) -> tuple[int, int]:
        return (min(self.max_prefill, max(self.min_prefill, prefill)),
                min(self.max_decode, max(self.min_decode, decode)))  # fmt: skip


@dataclass(frozen=True)
class ScalePolicy:
    slo: SLO
    bounds: ScaleBounds
    interval_s: float = 5.0  # how often it decides
    cooldown_s: float = 60.0  # how long a lower target must hold before a pool shrinks
    headroom: float = 0.8  # plan for p90s at most this share of the SLO
    horizon_s: float = 60.0  # seconds of the observed load each prediction simulates
    max_sim_requests: int = 1500  # ... at most this many requests

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or self.cooldown_s < 0:
            raise ValueError("--scale-interval must be > 0 and the cooldown >= 0 seconds")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {self.headroom}")
