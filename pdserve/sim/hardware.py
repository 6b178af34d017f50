"""Hardware presets: accelerators (peak FLOPs, memory bandwidth and size) and links.

GPU figures are vendor datasheet numbers: dense (not sparse) BF16 tensor FLOP/s, HBM bandwidth
and capacity, plus the intra-node link used for tensor-parallel all-reduce. Link figures give a
theoretical line rate and a practical effective rate (what a well-tuned bulk transfer reaches:
RDMA ~92 % of line rate, TCP/RoCE over Ethernet ~88 %, PCIe ~78 % after protocol overhead,
NVLink ~80 %; the seed quotes 10-11 GB/s practical for 100 Gbps Ethernet). RDMA fabrics
(InfiniBand, 200G+ RoCE) give every GPU its own port, as in DGX/HGX nodes; commodity 10/25/100
GbE is one port per 8-GPU node (as on cloud GPU instances without RDMA), so its bandwidth is
shared by the node's GPUs (`gpus_per_port`). This machine's CPU
is not a preset: `pdserve profile` measures it and `Accelerator.from_profile` reads it back.

Price and power per device are what `pdserve plan --optimize cost|power` weighs. They are
ASSUMPTIONS, not measurements: prices are approximate 2025 public on-demand list prices per
GPU-hour of the cheaper GPU clouds (e.g. Lambda Cloud's H100 SXM $2.99 and A100 SXM 80 GB
$1.79), power is the vendor datasheet's board power (TDP: H100 SXM 700 W, A100 SXM 400 W).
Both are overridden per device with `--gpu-cost h100=4.5,a100-80gb=2.1` and `--gpu-power`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """A point-to-point link; bandwidths in bytes per second, one direction."""

    name: str
    description: str
    theoretical_bytes_per_s: float
    practical_bytes_per_s: float
    latency_s: float = 0.0
    gpus_per_port: int = 1

    def __post_init__(self) -> None:
        if self.gpus_per_port < 1:
            raise ValueError(f"link {self.name!r}: gpus_per_port must be >= 1")
        if not 0 < self.practical_bytes_per_s <= self.theoretical_bytes_per_s:
            raise ValueError(
                f"link {self.name!r}: need 0 < practical <= theoretical bandwidth, got "
                f"{self.practical_bytes_per_s} and {self.theoretical_bytes_per_s}"
            )
        if self.latency_s < 0:
            raise ValueError(f"link {self.name!r}: latency must be >= 0 s")

    @classmethod
    def from_gbps(cls, gbps: float, name: str | None = None) -> Link:
        """A link of `gbps` gigabits/s, taken as both theoretical and practical (measured)."""
        if not gbps > 0:
            raise ValueError(f"bandwidth must be > 0 Gbps, got {gbps}")
        rate = gbps * 1e9 / 8
        return cls(name or f"{gbps:g}gbps", f"{gbps:g} Gbps (as given)", rate, rate)

    def instance_bytes_per_s(self, gpus: int) -> float:
        """Practical bandwidth an instance of `gpus` GPUs gets: its share of the ports."""
        return self.practical_bytes_per_s * gpus / self.gpus_per_port


def _link(name, desc, theo_gbs, eff, latency_us, gpus_per_port=1) -> Link:
    return Link(name, desc, theo_gbs * 1e9, theo_gbs * eff * 1e9, latency_us * 1e-6, gpus_per_port)


_ETH = 0.88  # 100 GbE: 12.5 GB/s line rate -> 11 GB/s effective, the seed's "~10-11 GB/s"
_IB = 0.92

LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        # The seed's "NVLink (900 GB/s on H100)": NVLink 4's total bandwidth per GPU.
        _link("nvlink4", "NVLink 4 (H100/H200), 900 GB/s per GPU", 900, 0.80, 1),
        _link("nvlink3", "NVLink 3 (A100), 600 GB/s per GPU", 600, 0.80, 1),
        _link("nvlink5", "NVLink 5 (B200), 1800 GB/s per GPU", 1800, 0.80, 1),
        _link("infinity-fabric", "AMD Infinity Fabric (MI300X), 896 GB/s per GPU", 896, 0.75, 3),
        _link("pcie-gen4", "PCIe Gen4 x16, 32 GB/s", 32, 0.78, 2),
        _link("pcie-gen5", "PCIe Gen5 x16, 64 GB/s", 64, 0.78, 2),
        _link("ib-hdr", "InfiniBand HDR, 200 Gbps = 25 GB/s", 25, _IB, 3),
        _link("ib-ndr", "InfiniBand NDR, 400 Gbps = 50 GB/s", 50, _IB, 3),
        _link("ib-xdr", "InfiniBand XDR, 800 Gbps = 100 GB/s", 100, _IB, 3),
        _link("10gbe", "10 Gb Ethernet, 1.25 GB/s, one per node", 1.25, _ETH, 20, 8),
        _link("25gbe", "25 Gb Ethernet, 3.125 GB/s, one per node", 3.125, _ETH, 15, 8),
        _link("100gbe", "100 Gb Ethernet, 12.5 GB/s, one per node", 12.5, _ETH, 10, 8),
        _link("200gbe", "200 Gb Ethernet, 25 GB/s", 25, _ETH, 10),
        _link("400gbe", "400 Gb Ethernet, 50 GB/s", 50, _ETH, 10),
        _link("800gbe", "800 Gb Ethernet, 100 GB/s", 100, _ETH, 10),
    )
}
STANDARD_LINKS = tuple(n for n in LINKS if n not in ("nvlink3", "nvlink5", "infinity-fabric"))


def get_link(name: str) -> Link:
    """A link preset by name; ValueError lists the names."""
    link = LINKS.get(name.strip().lower())
    if link is None:
        raise ValueError(f"unknown link {name!r}; choose one of {', '.join(LINKS)}")
    return link


@dataclass(frozen=True)
class Accelerator:
    """One device: peak FLOP/s at the serving dtype, memory bandwidth (B/s) and size (B)."""

    name: str
    description: str
    peak_flops: float
    mem_bytes_per_s: float
    mem_bytes: float
    tp_link: str = "nvlink4"
    max_tp: int = 8
    cost_per_hour: float = 0.0  # $ per device-hour (0: unknown; an assumption, see above)
    power_w: float = 0.0  # board power in watts (0: unknown)

    def __post_init__(self) -> None:
        for field in ("peak_flops", "mem_bytes_per_s", "mem_bytes"):
            if not getattr(self, field) > 0:
                raise ValueError(f"accelerator {self.name!r}: {field} must be > 0")
        for field in ("cost_per_hour", "power_w"):
            if not 0 <= getattr(self, field) < float("inf"):
                raise ValueError(f"accelerator {self.name!r}: {field} must be a number >= 0")
        get_link(self.tp_link)

    @classmethod
    def from_profile(cls, hardware: dict) -> Accelerator:
        """The measured entry that `pdserve profile` writes under "hardware"."""
        return cls(
            name=hardware["name"],
            description=hardware.get("description", "measured by pdserve profile"),
            peak_flops=float(hardware["peak_flops"]),
            mem_bytes_per_s=float(hardware["mem_bytes_per_s"]),
            mem_bytes=float(hardware["mem_bytes"]),
            tp_link=hardware.get("tp_link", "pcie-gen4"),
            max_tp=int(hardware.get("max_tp", 1)),
            cost_per_hour=float(hardware.get("cost_per_hour", 0.0)),
            power_w=float(hardware.get("power_w", 0.0)),
        )


def _gpu(name, desc, tflops, tb_s, gb, link, dollars, watts):
    return Accelerator(name, desc, tflops * 1e12, tb_s * 1e12, gb * 1e9, link, 8, dollars, watts)


GPUS: dict[str, Accelerator] = {
    gpu.name: gpu
    for gpu in (
        # name, description, dense BF16 TFLOP/s, TB/s, GB, TP link, $/device-hour, watts
        _gpu("a100-40gb", "NVIDIA A100 SXM 40 GB", 312, 1.555, 40, "nvlink3", 1.29, 400),
        _gpu("a100-80gb", "NVIDIA A100 SXM 80 GB", 312, 2.039, 80, "nvlink3", 1.79, 400),
        _gpu("h100-sxm", "NVIDIA H100 SXM 80 GB", 989, 3.35, 80, "nvlink4", 2.99, 700),
        _gpu(
            "h100-pcie",
            "NVIDIA H100 PCIe 80 GB (NVLink bridge)",
            756,
            2.0,
            80,
            "nvlink3",
            2.49,
            350,
        ),  # fmt: skip
        _gpu("h200", "NVIDIA H200 SXM 141 GB", 989, 4.8, 141, "nvlink4", 3.79, 700),
        _gpu("b200", "NVIDIA B200 180 GB", 2250, 8.0, 180, "nvlink5", 4.99, 1000),
        _gpu(
            "l40s", "NVIDIA L40S 48 GB (PCIe, no NVLink)", 362, 0.864, 48, "pcie-gen4", 0.99, 350
        ),  # fmt: skip
        _gpu(
            "mi300x", "AMD Instinct MI300X 192 GB", 1307, 5.3, 192, "infinity-fabric", 2.49, 750
        ),  # fmt: skip
    )
}
_GPU_ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb"}


def get_gpu(name: str) -> Accelerator:
    """A GPU preset by name ("h100" means the SXM part); ValueError lists the names."""
    key = name.strip().lower()
    gpu = GPUS.get(_GPU_ALIASES.get(key, key))
    if gpu is None:
        raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join([*GPUS, 'h100'])}")
    return gpu


def parse_figures(text: str | None, flag: str) -> dict[str, float]:
    """`h100=4.5,a100-80gb=2.1` (a --gpu-cost / --gpu-power value) as {device name: figure};
    preset aliases resolve ("h100" is h100-sxm); other names (a profile path, "cpu") are kept
    as given. ValueError names the malformed entry."""
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, eq, value = item.partition("=")
        try:
            figure = float(value)
        except ValueError:
            figure = -1.0
        if not eq or not name.strip() or not 0 <= figure < float("inf"):
            raise ValueError(
                f"{flag}: {item.strip()!r} is not DEVICE=NUMBER (e.g. {flag} h100=4.5,a100=2.1)"
            )
        key = name.strip().lower()
        out[_GPU_ALIASES.get(key, key)] = figure
    return out
