"""`pdserve kv-size | profile | simulate | plan`: the planner's commands.

Registering imports argparse and the defaults of the configs the flags fill (no numpy);
handlers (in `pdserve.sim.commands`) import what they need.
"""

from __future__ import annotations

import argparse

from pdserve.router.config import RouterConfig
from pdserve.sim.deployment import MODES, Deployment


def _handler(name: str):
    def run(args: argparse.Namespace) -> int:
        from pdserve.sim import commands

        return getattr(commands, name)(args)

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add kv-size, profile, simulate and plan to the `pdserve` parser."""
    _register_kv_size(subparsers)
    _register_profile(subparsers)
    _register_simulate(subparsers)
    _register_plan(subparsers)


def _register_kv_size(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "kv-size",
        help="KV-cache bytes of a prompt and its transfer time over each link",
        description="Print the KV-cache bytes per token and per prompt (exact bytes, GB and "
        "GiB) and the time to send them over NVLink, PCIe, InfiniBand and Ethernet at "
        "theoretical and practical bandwidth. Handles MHA, GQA, MQA and MLA.",
    )
    p.add_argument("--model", required=True, help="preset name (e.g. llama-3.1-70b) or a HF "
                   "config.json path")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, required=True, help="prompt length in tokens")
    p.add_argument("--dtype", default="fp16", help="KV dtype: fp32, fp16, bf16, fp8, int4, "
                   "int8 (pdserve's --kv-cache-dtype int8: + a 4-byte scale a row) "
                   "(default fp16)")  # fmt: skip
    p.add_argument("--link", help="show only this link (e.g. 100gbe, ib-ndr, nvlink4)")
    p.add_argument("--bandwidth-gbps", type=float, help="show only a link of this many Gbps")
    p.set_defaults(func=_handler("kv_size"))


def _register_profile(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="time the real engine on this machine and fit the simulator's efficiencies",
        description="Measure this CPU (matmul FLOP/s, memory and loopback bandwidth), time the "
        "engine's prefill and decode over a grid of batch sizes and lengths, fit the latency "
        "model's efficiencies and overheads, and write a JSON profile for `pdserve simulate "
        "--profile` and `pdserve plan --profile`.",
    )
    p.add_argument("--model", help="engine model path (default: the bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="engine dtype (default auto)")  # fmt: skip
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--weights", default="auto", choices=("auto", "bf16", "int8", "int4"),
                   help="the engine's weight format, as a worker's --weights: profile each "
                   "pool's own with its --prefill-args/--decode-args (default auto)")  # fmt: skip
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps per timing "
                   "(default 32)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="timings per point; the median counts "
                   "(default 3)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a small grid, one repeat (smoke tests)")
    p.add_argument("--out", default="profile.json", help="where to write the profile JSON")
    p.add_argument("--serving-url", metavar="URL", help="also fit the serving path's overhead "
                   "(per request, per step) against an idle `pdserve serve` at URL (e.g. "
                   "http://127.0.0.1:8000/v1); --threads should match its workers' cores "
                   "(on 2 cores: 2 co-located, 1 disaggregated)")  # fmt: skip
    p.add_argument("--serving-mode", choices=MODES, default="colocated",
                   help="the --mode that server runs (default colocated)")  # fmt: skip
    p.add_argument("--from-steps", metavar="DIR", help="instead of timing the engine, refit the "
                   "profile at --out (made by `pdserve profile` earlier) to the steps a served "
                   "engine logged in DIR (`pdserve serve --step-log DIR`): the engine's speed as "
                   "it served, beside the router and client on the same cores")  # fmt: skip
    p.set_defaults(func=_handler("profile"))


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hardware and model")
    g.add_argument("--model", help="preset or HF config.json (default with --profile: its model)")
    g.add_argument("--gpu", help="GPU preset: a100-40gb, a100-80gb, h100 (SXM), h100-pcie, h200, "
                   "b200, l40s, mi300x; or cpu (needs --profile). Default h100, or cpu with "
                   "--profile")  # fmt: skip
    g.add_argument("--link", default="ib-ndr", help="KV link between prefill and decode: "
                   "nvlink4, pcie-gen4/5, ib-hdr/ndr/xdr, 10/25/100/200/400/800gbe, or loopback "
                   "(measured by profile) (default ib-ndr)")  # fmt: skip
    g.add_argument("--bandwidth-gbps", type=float, help="a KV link of this many Gbps instead")
    g.add_argument("--profile", help="JSON from `pdserve profile`: fitted efficiencies (and the "
                   "CPU, for --gpu cpu)")  # fmt: skip
    g.add_argument("--dtype", default="bf16", help="weight dtype (default bf16; the profile's "
                   "with --profile)")  # fmt: skip
    g.add_argument("--kv-dtype", help="KV-cache dtype (default: the weight dtype)")
    g.add_argument("--prefill-gpu", metavar="DEVICE[,DEVICE]", help="the prefill pool's "
                   "hardware when it differs from --gpu (Splitwise): a GPU preset, cpu, or a "
                   "profile JSON from `pdserve profile` (a pool's own measured speed and weight "
                   "format); plan takes a list and searches each")  # fmt: skip
    g.add_argument("--decode-gpu", metavar="DEVICE[,DEVICE]", help="the decode pool's "
                   "hardware (same forms as --prefill-gpu)")  # fmt: skip
    g.add_argument("--gpu-cost", metavar="DEV=$,...", help="$ per device-hour, overriding the "
                   "presets' assumed list prices, e.g. h100=4.5,a100-80gb=2.1 (a profile's "
                   "device by its path)")  # fmt: skip
    g.add_argument("--gpu-power", metavar="DEV=W,...", help="watts per device, overriding "
                   "the presets' datasheet board power, e.g. h100=700")  # fmt: skip
    g.add_argument("--gpu-link", metavar="DEV=LINK,...", help="a device's own KV link when "
                   "it differs from --link, e.g. a100-80gb=ib-hdr; a transfer between two "
                   "devices runs at the slower end's")  # fmt: skip
    g.add_argument(
        "--kv-compression",
        choices=("none", "fp8"),
        default="none",
        help="KV on the wire between prefill and decode, as `pdserve serve "
        "--kv-compression`: fp8 halves the bytes of a 16-bit cache (default none)",
    )


def _add_workload_args(p: argparse.ArgumentParser, default_slo: tuple[float, float]) -> None:
    w = p.add_argument_group("workload and SLO (same syntax as pdserve bench)")
    w.add_argument("--workload", help="named mix: chat, docs or mixed")
    w.add_argument("--prompt-tokens", metavar="DIST", help="prompt lengths: N, fixed:N, "
                   "uniform:LO,HI or lognormal:MEAN,SIGMA")  # fmt: skip
    w.add_argument("--output-tokens", metavar="DIST", help="output lengths (same syntax)")
    w.add_argument("--rate", type=float, required=True, help="requests per second")
    w.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma arrivals: > 1 burstier")
    w.add_argument("--seed", type=int, default=0, help="same seed, same requests (default 0)")
    w.add_argument("--slo-ttft", type=float, default=default_slo[0], metavar="S",
                   help=f"time to first token target (default {default_slo[0]:g})")  # fmt: skip
    w.add_argument("--slo-tpot", type=float, default=default_slo[1], metavar="S",
                   help=f"time per output token target (default {default_slo[1]:g})")  # fmt: skip


def _register_simulate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate a deployment serving a workload (same metrics and JSON as bench)",
        description="Discrete-event simulation of co-located (optionally chunked-prefill) or "
        "disaggregated serving: TTFT/TPOT/ITL percentiles, SLO attainment and throughput, in "
        "the shape `pdserve bench` writes, so predictions and measurements compare directly.",
    )
    _add_cluster_args(p)
    _add_workload_args(p, (2.0, 0.1))
    p.add_argument("--num-requests", type=int, default=1000, help="requests (default 1000)")
    _add_deployment_args(p.add_argument_group("deployment"))
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="DIR", help="write DIR/results.json (bench's shape)")
    o.add_argument("--json", action="store_true", help="print the aggregates as JSON")
    p.set_defaults(func=_handler("simulate"))


def _add_deployment_args(d: argparse._ArgumentGroup) -> None:
    """A flag for each `Deployment` field (same name), defaulting to the field's default."""
    router_threshold = RouterConfig.local_prefill_threshold
    local = Deployment.local_prefill_threshold
    d.add_argument("--mode", choices=MODES, default=Deployment.mode)
    for name, text in (
        ("tp", "co-located: TP degree per instance"),
        ("replicas", "co-located: instances"),
        ("chunk", "chunked prefill: tokens per step (default off)"),
        ("prefill_tp", "disagg: TP per prefill instance"),
        ("num_prefill", "disagg: prefill instances"),
        ("decode_tp", "disagg: TP per decode instance"),
        ("num_decode", "disagg: decode instances"),
        (
            "local_prefill_threshold",
            "disagg: prompts shorter than this prefill on the decode instance, as pdserve's "
            f"router does (its default is {router_threshold}; default here {local} = always "
            "remote)",
        ),
        (
            "prefill_ep",
            "disagg: expert parallelism per prefill instance (MoE; a multiple of "
            "--prefill-tp; the instance holds max(TP, EP) devices)",
        ),
        ("decode_ep", "disagg: expert parallelism per decode instance (as --prefill-ep)"),
        (
            "prefill_pp",
            "disagg: pipeline stages per prefill instance, each of --prefill-tp (x EP) devices "
            "holding its share of the layers; --chunk is the micro-batch a prompt flows "
            "through them in (default 1)",
        ),
        ("max_num_seqs", "sequences per instance"),
        ("max_batched_tokens", "tokens per step without chunking (whole prompts always fit)"),
    ):
        flag = "--" + name.replace("_", "-")
        d.add_argument(flag, type=int, default=getattr(Deployment, name), help=text)
    d.add_argument("--prefill-pp-shared", action="store_true", help="disagg: the prefill "
                   "pipeline's stages share one stage's devices, as `pdserve serve` pins them "
                   "when a worker has fewer cores than stages: they overlap nothing, every "
                   "step costs each stage's pass and the hops")  # fmt: skip
    d.add_argument("--decode-pp", type=int, default=1, help="refused above 1, as by `pdserve "
                   "serve`: a decode step through a pipeline pays a hop per stage for every "
                   "token; use --decode-tp")  # fmt: skip


def _register_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="find the deployment with the fewest GPUs (or least cost or power) that serves a "
        "rate within the SLOs",
        description="Search co-located (x TP x chunk size) and disaggregated (x prefill TP x "
        "decode TP x P:D ratio, x prefill pipeline stages for long prompts, x EP for MoE, x "
        "each pool's hardware with --prefill-gpu / --decode-gpu) deployments by simulation for "
        "the fewest GPUs (--optimize cost: least $ per hour; power: least watts) that serve "
        "--rate with >= 90 %% SLO attainment (ties: highest goodput per GPU, dollar or watt), "
        "and explain the choice in numbers.",
    )
    _add_cluster_args(p)
    _add_workload_args(p, (0.5, 0.025))
    p.add_argument("--num-gpus", type=int, help="GPU budget (default: unbounded)")
    p.add_argument("--optimize", choices=("gpus", "cost", "power"), default="gpus",
                   help="what to minimise: devices (then goodput per device), $ per hour "
                   "(then goodput per dollar; --gpu-cost) or watts (--gpu-power) "
                   "(default gpus)")  # fmt: skip
    p.add_argument("--requests", type=int, default=300, help="requests per simulation in the "
                   "search (default 300; more is slower and less noisy)")  # fmt: skip
    p.add_argument("--top", type=int, default=3, help="runner-ups to show (default 3)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_handler("plan"))
