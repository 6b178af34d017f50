"""`pdserve kv-size | profile | simulate | plan`: the planner's commands.

Registering imports argparse only; each handler imports what it needs (numpy, torch) itself.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add kv-size, profile, simulate and plan to the `pdserve` parser."""
    _register_kv_size(subparsers)
    _register_profile(subparsers)


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
    p.add_argument("--dtype", default="fp16", help="KV dtype: fp32, fp16, bf16, fp8, int4 "
                   "(default fp16)")  # fmt: skip
    p.add_argument("--link", help="show only this link (e.g. 100gbe, ib-ndr, nvlink4)")
    p.add_argument("--bandwidth-gbps", type=float, help="show only a link of this many Gbps")
    p.set_defaults(func=_kv_size)


def _kv_size(args: argparse.Namespace) -> int:
    from pdserve.sim.kvsize import kv_size_report, links_for
    from pdserve.sim.models import get_model

    links = links_for(args.link, args.bandwidth_gbps)
    print(kv_size_report(get_model(args.model), args.prompt_tokens, args.dtype, links))
    return 0


def _register_profile(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="time the real engine on this machine and fit the simulator's efficiencies",
        description="Measure this CPU (matmul FLOP/s, memory bandwidth), time the engine's "
        "prefill and decode over a grid of batch sizes and lengths, fit the latency model's "
        "efficiencies and overheads, and write them as a JSON profile for `pdserve simulate "
        "--profile` and `pdserve plan --profile`.",
    )
    p.add_argument("--model", help="engine model path (default: the bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="engine dtype (default auto)")  # fmt: skip
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps per timing")
    p.add_argument("--quick", action="store_true", help="a smaller grid (for smoke tests)")
    p.add_argument("--out", default="profile.json", help="where to write the profile JSON")
    p.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pdserve.sim.calibration import measure_cpu, profile_document
    from pdserve.sim.hardware import Accelerator
    from pdserve.sim.profile import DEFAULT_DECODE, DEFAULT_PREFILL, engine_profile

    if args.decode_steps < 1:
        raise ValueError("--decode-steps must be >= 1")
    hardware = measure_cpu(args.threads)
    prefill, decode = DEFAULT_PREFILL, DEFAULT_DECODE
    if args.quick:
        prefill, decode = ((1, 16), (1, 64)), ((1, 32), (4, 32))
    points, spec, dtype, fit = engine_profile(
        args.model, args.dtype, args.threads, Accelerator.from_profile(hardware), prefill,
        decode, args.decode_steps,
    )  # fmt: skip
    doc = profile_document(hardware, spec, dtype, points, fit, args.decode_steps)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    eff = fit.efficiency
    print(f"hardware  {hardware['description']}: {hardware['peak_flops'] / 1e9:.1f} GFLOP/s, "
          f"{hardware['mem_bytes_per_s'] / 1e9:.1f} GB/s")  # fmt: skip
    for pt in points:
        print(f"  {pt.phase:<8} batch {pt.batch_size:>3} x {pt.tokens:>4} tokens: "
              f"{pt.seconds * 1e3:8.1f} ms")  # fmt: skip
    print(f"fit       mfu {eff.mfu:.3f}, mbu {eff.mbu:.3f}, overhead "
          f"{eff.iteration_overhead_s * 1e3:.2f} ms + {eff.per_seq_overhead_s * 1e3:.2f} ms/seq; "
          f"error median {fit.median_rel_error:.1%}, max {fit.max_rel_error:.1%}")  # fmt: skip
    print(f"wrote     {args.out}")
    return 0
