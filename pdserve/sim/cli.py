"""`pdserve kv-size | profile | simulate | plan`: the planner's commands.

Registering imports argparse only; each handler imports what it needs (numpy, torch) itself.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add kv-size, profile, simulate and plan to the `pdserve` parser."""
    _register_kv_size(subparsers)


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
