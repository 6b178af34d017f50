"""`pdserve bench` (load an OpenAI-compatible endpoint) and `pdserve bench compare`.

Registering imports argparse only; the handlers import numpy, aiohttp, matplotlib when run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import textwrap
import time
from pathlib import Path

GOODPUT_HELP = (
    "Goodput (DistServe's definition) is the highest request rate at which at least 90 %% of "
    "requests meet every SLO target (TTFT, TPOT, and the per-request p99 ITL when given); "
    "errors and timeouts count as misses."
)
EXAMPLES = """examples:
  pdserve bench --url http://127.0.0.1:8000/v1 --workload mixed --num-requests 40
  pdserve bench --url http://127.0.0.1:8080/v1 --prompt-tokens lognormal:1024,0.5 \\
      --output-tokens 128 --sweep 0.5,1,2,4 --slo-ttft 1 --slo-tpot 0.05
  pdserve bench compare --workload mixed --num-requests 40 --rate 1
"""


def _describe(text: str) -> str:
    return textwrap.fill(text + " " + GOODPUT_HELP.replace("%%", "%"), width=78)


def _add_common_args(p: argparse.ArgumentParser) -> None:
    """The options `bench` and `bench compare` share."""
    for add in (_add_workload_args, _add_load_args, _add_slo_and_output_args, _add_client_args):
        add(p)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        metavar="NAME",
        help="named mix: chat, docs, mixed or multiturn (default: chat)",
    )
    w.add_argument(
        "--prompt-tokens",
        metavar="DIST",
        help="prompt lengths instead of a named mix: N, fixed:N, uniform:LO,HI or "
        "lognormal:MEAN,SIGMA (e.g. lognormal:1024,0.5)",
    )
    w.add_argument("--output-tokens", metavar="DIST", help="output lengths (same syntax)")
    w.add_argument(
        "--prompts-file",
        metavar="JSONL",
        help='prompts from a file, one {"prompt": ..., "output_tokens"?: N} per line',
    )
    w.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer for exact prompt lengths: a GGUF file or HF folder, 'bundled' "
        "(the bundled model's, the default) or 'none' (approximate lengths)",
    )
    w.add_argument(
        "--seed", type=int, default=0, metavar="N", help="same seed, same requests (default 0)"
    )


def _add_load_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("load")
    a.add_argument(
        "--rate",
        metavar="PER_S",
        type=float,
        default=1.0,
        help="open-loop requests per second (default 1; inf sends all at once)",
    )
    a.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    a.add_argument(
        "--burstiness",
        metavar="B",
        type=float,
        default=1.0,
        help="gamma arrivals: 1 = Poisson, > 1 burstier, < 1 more regular",
    )
    a.add_argument(
        "--concurrency",
        metavar="N",
        type=int,
        help="closed loop: keep this many requests in flight (ignores --rate)",
    )
    a.add_argument("--num-requests", type=int, metavar="N", help="requests per run (default 100)")
    a.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="stop sending after this long (with --num-requests: whichever first)",
    )
    a.add_argument(
        "--sweep",
        metavar="RATES",
        help="runs at each rate, e.g. 0.5,1,2,4, and report goodput. " + GOODPUT_HELP,
    )
    a.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=600.0,
        help="per-request timeout in seconds; exceeding it is status 'timeout'",
    )


def _add_slo_and_output_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("SLO (seconds)")
    s.add_argument(
        "--slo-ttft", type=float, default=2.0, metavar="S", help="time to first token (default 2)"
    )
    s.add_argument(
        "--slo-tpot",
        metavar="S",
        type=float,
        default=0.1,
        help="time per output token after the first (default 0.1)",
    )
    s.add_argument(
        "--slo-itl-p99", type=float, metavar="S", help="per-request p99 inter-token latency"
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", metavar="DIR", help="default bench-results/<timestamp>/")
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("client")
    c.add_argument(
        "--model", metavar="NAME", help="model name sent in requests (and its tokenizer if a path)"
    )
    c.add_argument(
        "--api",
        choices=("completions", "chat"),
        default="completions",
        help="endpoint: /completions (exact prompt lengths) or /chat/completions",
    )
    c.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that reject unknown fields)",
    )
    c.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    c.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature (default 0: greedy; the OpenAI API's default is 1, "
        "and a sampled load costs a server its draws: pdserve's docs/results.md run 26)",
    )
    c.add_argument("--top-p", type=float, help="every request's top_p (default: not sent)")
    c.add_argument(
        "--extra-body",
        metavar="JSON",
        help="a JSON object merged into every request body, e.g. '{\"logprobs\": 2}' or "
        '\'{"response_format": {"type": "json_object"}}\' (the cost of a feature)',
    )


def register(subparsers) -> None:
    """Add `bench` and its `compare` action."""
    bench = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server; compare serving modes",
        description=_describe(
            "Send a synthetic or file-based workload to any OpenAI-compatible server "
            "(pdserve, llama.cpp's llama-server, vLLM) and measure TTFT, TPOT, every "
            "inter-token latency and end-to-end latency per request; writes results.json, "
            "PNG plots and summary.md."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--url", help="API base URL, e.g. http://127.0.0.1:8000/v1 (required)")
    bench.add_argument(
        "--request-log", metavar="FILE",
        help="a pdserve server's --request-log file: the report adds a TTFT breakdown (queue, "
        "decode wait, prefill, transfer per percentile) from the lines this run appends",
    )  # fmt: skip
    _add_common_args(bench)
    bench.set_defaults(func=_run_bench)
    actions = bench.add_subparsers(dest="bench_action", metavar="ACTION")
    _register_compare(actions)


def _register_compare(actions) -> None:
    compare = actions.add_parser(
        "compare",
        help="start `pdserve serve` in each mode, run one workload, report side by side",
        description=_describe(
            "For each mode (colocated, colocated+chunked, disagg) start `pdserve serve --mode "
            "... --host 127.0.0.1 --port P`, wait for GET /health, run the same workload, stop "
            "it; then write one report with the modes side by side and a 'which to use' "
            "paragraph computed from the measurements."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_common_args(compare)
    m = compare.add_argument_group("servers")
    m.add_argument(
        "--modes",
        metavar="LIST",
        default="colocated,colocated+chunked,disagg",
        help="comma-separated modes to measure, in order (default: all three)",
    )
    m.add_argument(
        "--chunk-size",
        metavar="TOKENS",
        type=int,
        default=256,
        help="prefill chunk in tokens for colocated+chunked (default 256)",
    )
    m.add_argument(
        "--serve-cmd",
        metavar="CMD",
        help="command that starts a server (default: this Python's "
        "`pdserve serve`); mode, host and port arguments are appended",
    )
    m.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every server, repeatable (e.g. --serve-arg=--model "
        "--serve-arg=PATH)",
    )
    m.add_argument(
        "--startup-timeout",
        metavar="SECONDS",
        type=float,
        default=300.0,
        help="seconds to wait for a server's /health (default 300)",
    )
    compare.set_defaults(func=_run_compare)


def _run_bench(args: argparse.Namespace) -> int:
    from pdserve.bench import session

    if not args.url:
        raise ValueError(
            "--url is required, e.g. --url http://127.0.0.1:8000/v1 "
            "(or use `pdserve bench compare` to start servers itself)"
        )
    return session.bench(args, _out_dir(args), _command_line())


def _run_compare(args: argparse.Namespace) -> int:
    from pdserve.bench import session

    return session.compare(args, _out_dir(args), _command_line())


def _out_dir(args: argparse.Namespace) -> Path:
    return Path(args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S"))


def _command_line() -> str:
    return "pdserve " + shlex.join(sys.argv[1:])
