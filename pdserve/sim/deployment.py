"""What is simulated: the hardware and model (`Cluster`) and the layout of instances
(`Deployment`), as frozen, validated configs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from pdserve.config import DECODE_CHUNK_SIZE, WORKER_CHUNK_SIZE, EngineConfig
from pdserve.router.config import RouterConfig
from pdserve.sim.hardware import Accelerator, Link, get_link
from pdserve.sim.kvmath import dtype_bits, kv_bytes
from pdserve.sim.latency import Efficiency, LatencyModel
from pdserve.sim.models import ModelSpec

MODES = ("colocated", "disagg")
# A served engine's token budget per step without chunking: the scheduler's
# max(max_num_batched_tokens, max_model_len), so that a whole prompt fits; 8192 is the bundled
# SmolLM2-135M's context.
SERVED_STEP_TOKENS = max(EngineConfig.max_num_batched_tokens, 8192)


@dataclass(frozen=True)
class ServingOverhead:
    """Seconds the serving path adds per request (to TTFT), per engine step and per sequence
    in each step. Part of a `Cluster`; `pdserve.sim.overhead` fits it to a real server."""

    request_s: float = 0.0
    step_s: float = 0.0
    seq_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.request_s, self.step_s, self.seq_s) < 0:
            raise ValueError(f"serving overheads must be >= 0 seconds, got {self}")


@dataclass(frozen=True)
class Device:
    """One pool's hardware: the accelerator, the engine's efficiencies and weight format on it,
    and the KV link its instances reach the other pool over (a transfer between two devices
    runs at the slower end's rate: the fabric caps every flow by both ends)."""

    accel: Accelerator
    eff: Efficiency
    weight_dtype: str
    link: Link

    @property
    def name(self) -> str:
        return self.accel.name


@dataclass(frozen=True)
class Cluster:
    """What the deployment runs on: model, device, KV link, efficiencies and dtypes, and the
    serving path's overhead per mode (`pdserve profile`'s serving calibration; none by default,
    as for a GPU preset). `devices` are further hardware a pool may name (heterogeneous pools,
    `Deployment.prefill_gpu` / `decode_gpu` / `gpu`); a pool naming none runs on `accel`."""

    model: ModelSpec
    accel: Accelerator
    link: Link
    eff: Efficiency = Efficiency()
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    serving: Mapping[str, ServingOverhead] = field(default_factory=dict)
    kv_wire: str = "none"  # --kv-compression: fp8 puts 8 bits per element on the wire
    devices: Mapping[str, Device] = field(default_factory=dict)

    def device(self, name: str | None = None) -> Device:
        """The hardware called `name` (None: the cluster's own `accel`); ValueError lists the
        names when there is none of that name."""
        if name is None:
            return Device(self.accel, self.eff, self.weight_dtype, self.link)
        if name not in self.devices:
            known = ", ".join(self.devices) or "none"
            raise ValueError(f"no device {name!r} in this cluster (it has: {known})")
        return self.devices[name]

    def wire_bytes(self, tokens: int) -> float:
        """Bytes a `tokens`-long prompt's KV puts on the link (FP8: 8 bits per element; its
        float32 scale per block, < 0.1 % of a block, is left out)."""
        nbytes = kv_bytes(self.model, tokens, self.kv_dtype)
        if self.kv_wire == "fp8":
            return nbytes * min(1.0, 8 / dtype_bits(self.kv_dtype))
        return nbytes

    def overhead(self, mode: str) -> ServingOverhead:
        """The serving overhead of `mode` (zero when none was calibrated)."""
        return self.serving.get(mode, ServingOverhead())

    def latency(
        self, tp: int, mode: str | None = None, gpu: str | None = None, ep: int = 1, pp: int = 1,
        shared_stages: bool = False,
    ) -> LatencyModel:  # fmt: skip
        """Iteration times at TP `tp` (EP `ep`, `pp` pipeline stages, on one stage's devices
        with `shared_stages`) on device `gpu` (None: `accel`); with a `mode`, every iteration
        also pays that mode's serving overhead per step and per sequence."""
        dev = self.device(gpu)
        eff = dev.eff
        if mode and mode in self.serving:
            over = self.serving[mode]
            eff = replace(eff, iteration_overhead_s=eff.iteration_overhead_s + over.step_s,
                          per_seq_overhead_s=eff.per_seq_overhead_s + over.seq_s)  # fmt: skip
        return LatencyModel(self.model, dev.accel, tp, eff, dev.weight_dtype, self.kv_dtype, ep,
                            pp, self.stage_link(gpu, _group(tp, ep) * pp),
                            shared_stages)  # fmt: skip

    def stage_link(self, gpu: str | None, devices: int) -> Link:
        """The link between a pipeline's stages on device `gpu`: the node's own (NVLink) while
        the instance's `devices` fit one node, else the network the KV moves over (every hop
        is costed at it, although stages sharing a node would hop faster)."""
        dev = self.device(gpu)
        return get_link(dev.accel.tp_link) if devices <= dev.accel.max_tp else dev.link


@dataclass(frozen=True)
class Deployment:
    """How instances are laid out. Co-located: `replicas` x TP `tp`, optional `chunk` size.
    Disaggregated: `num_prefill` x TP `prefill_tp` (x `prefill_pp` pipeline stages, whose
    micro-batches are `chunk`-token prefill chunks) and `num_decode` x TP `decode_tp`. More
    stages than the model has layers are refused when the instances are built
    (`Cluster.latency`)."""

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
    # Heterogeneous pools: a `Cluster.devices` name per pool (None: the cluster's `accel`).
    gpu: str | None = None
    prefill_gpu: str | None = None
    decode_gpu: str | None = None
    # Expert parallelism per pool (MoE): experts over this many ranks, a multiple of the TP.
    prefill_ep: int = 1
    decode_ep: int = 1
    # Pipeline parallelism of the prefill pool (`--prefill-pp`): stages of prefill_tp x EP each,
    # or all on one stage's devices (`--prefill-pp-shared`: a worker with fewer cores than stages)
    prefill_pp: int = 1
    prefill_pp_shared: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(
                f"deployment mode must be one of {', '.join(MODES)}, got {self.mode!r}"
            )
        counts = ("tp", "replicas", "prefill_tp", "num_prefill", "decode_tp", "num_decode",
                  "prefill_ep", "decode_ep", "prefill_pp")  # fmt: skip
        for name in (*counts, "max_num_seqs", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for tp, ep, flag in ((self.prefill_tp, self.prefill_ep, "prefill"),
                             (self.decode_tp, self.decode_ep, "decode")):  # fmt: skip
            if ep > 1 and ep % tp:
                raise ValueError(f"--{flag}-ep {ep} must be a multiple of --{flag}-tp {tp}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0 tokens")
        if self.prefill_pp > 1 and self.mode != "disagg":
            raise ValueError(
                f"--prefill-pp {self.prefill_pp} pipelines the prefill pool of --mode disagg; "
                "a co-located deployment has none (use --tp)"
            )
        if self.prefill_pp_shared and self.prefill_pp == 1:
            raise ValueError("--prefill-pp-shared puts a prefill pipeline's stages on one "
                             "stage's devices: add --prefill-pp N (N > 1)")  # fmt: skip
        for name in ("chunk", "decode_chunk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} size must be >= 1 token, got {value}")

    @classmethod
    def served(cls, mode: str, replicas: int = 1) -> Deployment:
        """What `pdserve serve --mode MODE` runs with its defaults: `replicas` workers
        co-located (--colocated-workers; steps of `WORKER_CHUNK_SIZE` tokens), or one prefill
        and one decode worker with the router's conditional disaggregation (short prompts on
        the decode worker while the prefill pool is busy; an idle pool takes them) and the
        decode worker's own prefills in steps of `DECODE_CHUNK_SIZE` tokens
        (--decode-chunk-size). The engine's defaults: `EngineConfig.max_num_seqs` sequences;
        unchunked, whole prompts up to the bundled model's 8k context (`SERVED_STEP_TOKENS`)."""
        engine = {
            "max_num_seqs": EngineConfig.max_num_seqs,
            "max_batched_tokens": SERVED_STEP_TOKENS,
        }
        if mode != "disagg":
            return cls(mode, replicas=replicas, chunk=WORKER_CHUNK_SIZE["both"], **engine)
        router = {
            "local_prefill_threshold": RouterConfig.local_prefill_threshold,
            "short_prefills_to_idle_pool": RouterConfig.short_prefills_to_idle_pool,
        }
        return cls(mode, **router, decode_chunk=DECODE_CHUNK_SIZE, **engine)

    def pools(self) -> list[Pool]:
        """Each pool: "colocated", or "prefill" and "decode"."""
        if self.mode == "colocated":
            return [Pool("colocated", self.gpu, self.replicas, self.tp, 1)]
        prefill = Pool("prefill", self.prefill_gpu, self.num_prefill, self.prefill_tp,
                       self.prefill_ep, self.prefill_pp, self.prefill_pp_shared)  # fmt: skip
        decode = Pool("decode", self.decode_gpu, self.num_decode, self.decode_tp, self.decode_ep)
        return [prefill, decode]

    @property
    def num_gpus(self) -> int:
        return sum(p.devices for p in self.pools())

    @property
    def heterogeneous(self) -> bool:
        """Prefill and decode on different hardware."""
        return self.mode == "disagg" and self.prefill_gpu != self.decode_gpu

    def gpus_by_device(self, cluster: Cluster) -> dict[str, int]:
        """Devices of each hardware type the deployment holds, by name."""
        out: dict[str, int] = {}
        for p in self.pools():
            name = cluster.device(p.gpu).name
            out[name] = out.get(name, 0) + p.devices
        return out

    def cost_per_hour(self, cluster: Cluster) -> float:
        """$ per hour of all its devices (each device's `cost_per_hour`, an assumption)."""
        return sum(p.devices * cluster.device(p.gpu).accel.cost_per_hour for p in self.pools())

    def power_w(self, cluster: Cluster) -> float:
        """Watts of all its devices at board power."""
        return sum(p.devices * cluster.device(p.gpu).accel.power_w for p in self.pools())

    @property
    def label(self) -> str:
        def on(gpu: str | None) -> str:
            return f" on {_short(gpu)}" if gpu else ""

        if self.mode == "colocated":
            chunk = f", chunked prefill {self.chunk}" if self.chunk else ""
            return f"co-located {self.replicas} x TP{self.tp}{on(self.gpu)}{chunk}"
        pep = f" EP{self.prefill_ep}" if self.prefill_ep > 1 else ""
        pep += f" PP{self.prefill_pp}" if self.prefill_pp > 1 else ""
        pep += " (shared)" if self.prefill_pp_shared else ""
        dep = f" EP{self.decode_ep}" if self.decode_ep > 1 else ""
        return (
            f"disaggregated {self.num_prefill}P x TP{self.prefill_tp}{pep}{on(self.prefill_gpu)} : "
            f"{self.num_decode}D x TP{self.decode_tp}{dep}{on(self.decode_gpu)}"
        )


class Pool(NamedTuple):
    """One pool of a deployment: its device name (None: the cluster's `accel`), instances and
    each instance's TP, EP and pipeline stages (all on one stage's devices when `shared`)."""

    name: str
    gpu: str | None
    instances: int
    tp: int
    ep: int
    pp: int = 1
    shared: bool = False

    @property
    def instance_devices(self) -> int:
        """Devices of one instance: `pp` stages of a TP group (or EP ranks when wider)."""
        return _group(self.tp, self.ep) * (1 if self.shared else self.pp)

    @property
    def devices(self) -> int:
        return self.instances * self.instance_devices


def _group(tp: int, ep: int) -> int:
    """GPUs of one instance: its TP group, or its EP ranks when experts span more."""
    return max(tp, ep)


def _short(gpu: str) -> str:
    """A device name for labels: a profile path's file name."""
    return gpu.rsplit("/", 1)[-1]
