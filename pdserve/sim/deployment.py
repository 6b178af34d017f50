"""What is simulated: the hardware and model (`Cluster`) and the layout of instances
(`Deployment`), as frozen, validated configs."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.sim.hardware import Accelerator, Link
from pdserve.sim.latency import Efficiency, LatencyModel
from pdserve.sim.models import ModelSpec

MODES = ("colocated", "disagg")


@dataclass(frozen=True)
class Cluster:
    """What the deployment runs on: model, device, KV link, efficiencies and dtypes."""

    model: ModelSpec
    accel: Accelerator
    link: Link
    eff: Efficiency = Efficiency()
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"

    def latency(self, tp: int) -> LatencyModel:
        return LatencyModel(self.model, self.accel, tp, self.eff, self.weight_dtype, self.kv_dtype)


@dataclass(frozen=True)
class Deployment:
    """How instances are laid out. Co-located: `replicas` x TP `tp`, optional `chunk` size.
    Disaggregated: `num_prefill` x TP `prefill_tp` and `num_decode` x TP `decode_tp`."""

    mode: str = "colocated"
    tp: int = 1
    replicas: int = 1
    chunk: int | None = None
    prefill_tp: int = 1
    num_prefill: int = 1
    decode_tp: int = 1
    num_decode: int = 1
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    local_prefill_threshold: int = 0  # disagg: shorter prompts prefill on the decode instance
    # ... unless the prefill pool has nothing queued (the router's default rule; the planner
    # keeps the simpler threshold-only policy)
    short_prefills_to_idle_pool: bool = False
    decode_chunk: int | None = None  # disagg: token budget of a decode instance's steps

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"deployment mode must be one of {', '.join(MODES)}, got {self.mode!r}"
            )
        counts = ("tp", "replicas", "prefill_tp", "num_prefill", "decode_tp", "num_decode")
        for name in (*counts, "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0 tokens")
        for name in ("chunk", "decode_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} size must be >= 1 token, got {value}")

    @property
    def num_gpus(self) -> int:
        if self.mode == "colocated":
            return self.tp * self.replicas
        return self.prefill_tp * self.num_prefill + self.decode_tp * self.num_decode

    @property
    def label(self) -> str:
        if self.mode == "colocated":
            chunk = f", chunked prefill {self.chunk}" if self.chunk else ""
            return f"co-located {self.replicas} x TP{self.tp}{chunk}"
        return (
            f"disaggregated {self.num_prefill}P x TP{self.prefill_tp} : "
            f"{self.num_decode}D x TP{self.decode_tp}"
        )
