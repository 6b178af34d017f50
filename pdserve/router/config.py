"""RouterConfig: every router setting and its default, checked where it is defined."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import default_block_size

MODES = ("disagg", "colocated")


@dataclass(frozen=True)
class RouterConfig:
    control_host: str = "127.0.0.1"
    control_port: int = 0
    mode: str = "disagg"  # disagg | colocated
    local_prefill_threshold: int = 256  # uncached prompt tokens below this prefill on D ...
    short_prefills_to_idle_pool: bool = True  # ... unless the prefill pool has nothing queued
    lease_s: float = 120.0
    heartbeat_timeout_s: float = 5.0
    # the workers' (--block-size), so that prefix hashes match; None: default_block_size(mode)
    block_size: int | None = None
    max_inflight: int = 256  # admission control: beyond this, 429
    # SLO-aware admission (None = off): refuse a request whose estimated TTFT, or whose decode
    # worker's measured time per output token, already misses the target.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # `serve --autoscale`: the most prefill and decode workers the pools may grow to. Admission
    # then refuses only what pools of that size could not serve (`admission.check_slo`).
    autoscale_max: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.block_size is None:
            object.__setattr__(self, "block_size", default_block_size(self.mode == "colocated"))
        for flag, value in (("--slo-ttft", self.slo_ttft_s), ("--slo-tpot", self.slo_tpot_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
        positive = (
            ("--lease-s", self.lease_s),
            ("--heartbeat-timeout-s", self.heartbeat_timeout_s),
            ("--block-size", self.block_size),
            ("--max-inflight", self.max_inflight),
        )
        for flag, value in positive:
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        if self.local_prefill_threshold < 0:
            raise ValueError(
                f"--local-prefill-threshold must be >= 0, got {self.local_prefill_threshold}"
            )
        if not 0 <= self.control_port < 65536:
            raise ValueError(f"--control-port must be in [0, 65535], got {self.control_port}")
