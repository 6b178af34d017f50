"""The flags of `pdserve serve`, `pdserve router` and `pdserve worker` (argparse only, cheap to
import); what each command does is in `launch/commands.py`."""

from __future__ import annotations

import argparse

from pdserve import envs
from pdserve.config import DECODE_CHUNK_SIZE
from pdserve.engine.cli import add_engine_args
from pdserve.kv_transfer.registry import TRANSPORTS
from pdserve.launch import commands
from pdserve.protocol.messages import DRAIN_TIMEOUT_S, ROUTER_TIMEOUT_S, TRANSFER_TIMEOUT_S
from pdserve.router.config import MODES, RouterConfig


def _drain_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DRAIN_TIMEOUT_S,
        metavar="S",
        help=f"on SIGTERM {what} (default {DRAIN_TIMEOUT_S:g}); SIGINT or a second SIGTERM "
        "stops at once",
    )


def _autoscale_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "autoscaling (--mode disagg, either launcher; docs/serving.md#autoscaling)"
    )
    g.add_argument(
        "--autoscale",
        action="store_true",
        help="size the prefill and decode pools while serving: every --scale-interval the "
        "simulator, calibrated to the workers' measured speeds, predicts TTFT and TPOT p90 of the "
        "observed load for candidate counts, and the pools move to the cheapest that meets "
        "--slo-ttft and --slo-tpot with 20%% headroom (also growing on a measured SLO miss or a "
        "growing prefill queue). --prefill/--decode are the minimums. Admission then refuses "
        "only what the largest allowed pools could not serve",
    )
    g.add_argument("--max-prefill", type=int, default=None, metavar="N",
                   help="--autoscale: most prefill workers (default: --prefill)")  # fmt: skip
    g.add_argument("--max-decode", type=int, default=None, metavar="N",
                   help="--autoscale: most decode workers (default: --decode)")  # fmt: skip
    g.add_argument(
        "--scale-interval", type=float, default=5.0, metavar="S",
        help="--autoscale: seconds between decisions (default 5); a pool grows at the first "
        "decision that asks for it",
    )  # fmt: skip
    g.add_argument(
        "--scale-cooldown", type=float, default=60.0, metavar="S",
        help="--autoscale: a pool shrinks only once its last change is S seconds old, and only "
        "to the most any decision of the last S seconds asked for (default 60); the workers "
        "removed drain first (finish their requests, then leave)",
    )  # fmt: skip


def _router_args(p: argparse.ArgumentParser) -> None:
    """The router's flags; their defaults are `RouterConfig`'s (its class attributes)."""
    _drain_arg(p, "refuse new requests (503 + Retry-After) and let those admitted finish, "
               "for at most S seconds, then stop with exit status 0")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0 = any free port)")
    p.add_argument(
        "--control-host",
        default=RouterConfig.control_host,
        help="bind address of the worker control socket; non-loopback needs PDSERVE_SECRET",
    )
    p.add_argument(
        "--control-port",
        type=int,
        default=RouterConfig.control_port,
        help="control socket port (default: any free)",
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default=RouterConfig.mode,
        help="disagg: prefill and decode pools; colocated: one engine does both",
    )
    p.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=RouterConfig.local_prefill_threshold,
        help="conditional disaggregation: prompts whose uncached part is shorter than this "
        "many tokens are prefilled on the decode worker while the prefill pool is busy "
        f"(default {RouterConfig.local_prefill_threshold}); an idle pool takes them, so decoding "
        "streams are not paused",
    )
    p.add_argument(
        "--keep-short-prefills-local",
        action="store_true",
        help="prefill every prompt under --local-prefill-threshold on the decode worker, even "
        "when the prefill pool is idle (lowest TTFT for short prompts, at the cost of pausing "
        "the decode worker's streams while it prefills)",
    )
    p.add_argument(
        "--lease-s",
        type=float,
        default=RouterConfig.lease_s,
        help=f"KV lease deadline on decode workers (default {RouterConfig.lease_s:g} s). A dead "
        "prefill worker is detected by heartbeats much sooner; the lease is the backstop for "
        "lost messages and long prefill queues",
    )
    p.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=RouterConfig.heartbeat_timeout_s,
        help="silence before a worker is dead",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=RouterConfig.max_inflight,
        help="admission control: requests in flight before new ones get 429 with Retry-After",
    )
    p.add_argument(
        "--slo-ttft",
        type=float,
        default=RouterConfig.slo_ttft_s,
        metavar="SECONDS",
        help="SLO-aware admission: answer 429 (with Retry-After) to a new request when the "
        "prompt tokens already queued for prefill, at the workers' measured prefill speed, "
        "would make its time to first token exceed this (default: off)",
    )
    p.add_argument(
        "--slo-tpot",
        type=float,
        default=RouterConfig.slo_tpot_s,
        metavar="SECONDS",
        help="SLO-aware admission: answer 429 when the chosen decode worker's measured time "
        "per output token already exceeds this (default: off). Admitted requests are never "
        "dropped to make room",
    )
    p.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="require 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY, else none)",
    )
    p.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="accept these API keys (one 'KEY [REQUESTS_PER_S]' per line; a rate limits that "
        "key: 429 beyond it); each key is a tenant for fair admission under overload",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        metavar="N",
        help="at --max-inflight, requests of one tenant that may wait for a turn (fairly: "
        "lowest priority value, then the tenant with the fewest in flight); more: 429",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long a request waits for a turn at --max-inflight before a 429",
    )
    p.add_argument(
        "--model-name", default=None, help="name served in /v1/models (default: file name)"
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|FILE",
        help="chat template for /v1/chat/completions instead of the model's: a Jinja file, or "
        "a shipped one by name (llama3_json_tools: Llama-3 JSON tool calling, for models whose "
        "own template does not render tools)",
    )


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="start the router and workers on this machine",
        description="Start the OpenAI-compatible router and its workers on this machine. "
        "Default: disaggregated, one prefill worker and one decode worker, one core each, "
        "with the bundled model. Prints the URL and an example curl when ready.",
    )
    _router_args(p)
    add_engine_args(p)
    p.add_argument(
        "--prefill", type=int, default=1, help="prefill workers (disagg mode, default 1)"
    )
    p.add_argument("--decode", type=int, default=1, help="decode workers (disagg mode, default 1)")
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-tp",
            type=int,
            default=None,
            metavar="N",
            help=f"disagg mode: tensor-parallel size of each {role} worker (default: "
            "--tensor-parallel-size). Prefill and decode sizes may differ: the KV heads are "
            "re-sharded on the way (`pdserve plan` recommends a size per phase)",
        )
    p.add_argument(
        "--colocated-workers", type=int, default=1, help="workers in colocated mode (default 1)"
    )
    _autoscale_args(p)
    p.add_argument(
        "--decode-chunk-size",
        type=int,
        default=DECODE_CHUNK_SIZE,
        metavar="N",
        help="disagg mode: a decode worker computes the prompts it keeps (short ones while the "
        "prefill pool is busy, warm suffixes, migrated streams) at most N tokens per step, its "
        "running streams' tokens included, so those streams keep flowing; with no stream "
        f"running it computes them whole (default {DECODE_CHUNK_SIZE}; 0 = always whole prompts "
        "in one step). Co-located workers use --chunk-size",
    )
    p.add_argument("--kv-transport", default="tcp", choices=TRANSPORTS, help="KV transfer backend")
    _kv_push_args(p)
    p.add_argument(
        "--startup-timeout-s",
        type=float,
        default=300.0,
        help="how long the workers may take to register before serve gives up (default 300)",
    )
    p.add_argument(
        "--launcher",
        choices=["local", "ray"],
        default="local",
        help="local: the workers are processes of this machine, pinned to its cores (default); "
        "ray: each worker is a Ray actor on a Ray cluster (--ray-address), placed by "
        "--prefill-resources/--decode-resources and node labels pdserve/role=prefill|decode, "
        "restarted by Ray if it dies (needs pdserve[ray])",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="auto|HOST:PORT",
        help="--launcher ray: the cluster to join (auto: the one `ray start` runs on this "
        "host); none given: start a local one on this machine's cores, as ray.init() does",
    )
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-resources",
            default=None,
            metavar="JSON",
            help=f"--launcher ray: the Ray resources of each {role} worker as JSON, e.g. "
            "'{\"CPU\": 2}' or '{\"GPU\": 1}' (default: one CPU, and one GPU when the cluster "
            "has GPUs; its engine gets as many threads as CPUs)",
        )
        p.add_argument(
            f"--{role}-args",
            default=None,
            metavar="FLAGS",
            help=f"engine flags for the {role} pool only, either launcher, e.g. "
            + ('"--chunk-size 1024"' if role == "prefill" else '"--max-num-seqs 128"')
            + " (given after the shared ones, so they win)",
        )
    p.add_argument(
        "--no-restart",
        action="store_true",
        help="do not restart a worker that exits (by default it is restarted with a backoff "
        "that doubles per crash, 1 s up to 30 s, and each exit is reported with its last "
        "output); for an outside supervisor such as systemd or Kubernetes",
    )
    p.add_argument(
        "--kv-store",
        action="store_true",
        help="also start a KV store (DRAM + SSD tiers) that workers load from and offload to; "
        "block bytes move over --kv-transport (tcp, or nixl: NIXL READs)",
    )
    p.add_argument(
        "--kv-store-endpoint",
        default=None,
        metavar="ENDPOINT",
        help="use an existing `pdserve store` at tcp://HOST:PORT (or nixl://HOST:PORT, a store "
        "started with --transport nixl) instead of starting one",
    )
    p.add_argument(
        "--store-dir", default=None, help="SSD tier directory (default: a temporary directory)"
    )
    p.add_argument(
        "--store-dram-gb", type=float, default=1.0, help="store DRAM tier size (default 1)"
    )
    p.add_argument(
        "--store-ssd-gb", type=float, default=4.0, help="store SSD tier size (default 4)"
    )
    p.add_argument(
        "--step-log",
        default=None,
        metavar="DIR",
        help="every worker appends one JSON line per engine step (start, seconds, batch shape) "
        "to DIR/steps-ROLE-PID.jsonl; `pdserve profile --from-steps DIR` calibrates the "
        "simulator from them (same as PDSERVE_STEP_LOG=DIR)",
    )
    p.set_defaults(func=commands.serve)

    p = sub.add_parser("router", help="start only the router (workers join with `pdserve worker`)")
    _router_args(p)
    add_engine_args(p)
    p.set_defaults(func=commands.router)

    p = sub.add_parser(
        "worker",
        help="start one engine worker that joins a router",
        description="One engine process with a role. It registers with the router, "
        "heartbeats, and serves requests the router places on it.",
    )
    p.add_argument("--role", choices=["prefill", "decode", "both"], required=True)
    p.add_argument(
        "--router",
        required=True,
        action="append",
        help="the router's control endpoint, tcp://HOST:PORT. Repeat it to serve two or more "
        "routers at once (active-active: a load balancer in front of them fails over); each "
        "request's messages go to the router that placed it, heartbeats to all",
    )
    p.add_argument(
        "--worker-id", default=None, help="stable id (a restarted worker re-registers under it)"
    )
    p.add_argument(
        "--cpus", default=None, help="pin to these cores, e.g. 0 or 2-3 (threads follow)"
    )
    p.add_argument("--kv-transport", default="tcp", choices=TRANSPORTS)
    _kv_push_args(p)
    _drain_arg(p, "take nothing new (the routers are told), finish the requests this worker "
               "holds, then exit 0; past S seconds exit anyway and the routers migrate what is "
               "left")  # fmt: skip
    p.add_argument(
        "--router-timeout-s",
        type=float,
        default=ROUTER_TIMEOUT_S,
        help="silence from the router (no answer to this worker's heartbeats) after which the "
        "worker drops the requests the router placed on it and frees their blocks, then "
        "registers again "
        f"when a router speaks (default {ROUTER_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--kv-host", default="127.0.0.1", help="address the KV receiver binds (decode role)"
    )
    p.add_argument(
        "--kv-store",
        default=None,
        metavar="ENDPOINT",
        help="a `pdserve store` endpoint (tcp://HOST:PORT, or nixl://HOST:PORT: block bytes by "
        "NIXL READs): load cached prefixes from it and "
        "offload finished requests' blocks to it",
    )
    add_engine_args(p)
    p.set_defaults(func=commands.worker)


def _kv_push_args(p) -> None:
    p.add_argument(
        "--kv-compression",
        choices=["none", "fp8"],
        default="none",
        help="KV on the wire from prefill to decode workers: fp8 (e4m3 with a scale per "
        "block) halves the bytes of a 16-bit cache, for links slower than the CPU; lossy (see "
        "docs/results.md for its effect on outputs); tcp only (default none)",
    )
    p.add_argument(
        "--transfer-timeout-s",
        type=float,
        default=TRANSFER_TIMEOUT_S,
        metavar="S",
        help="a prefill worker gives up a KV push that its decode worker has not acknowledged "
        f"S seconds after the prompt was computed (default {TRANSFER_TIMEOUT_S:g}); the decode "
        "worker then prefills the prompt itself. Only that request waits: the prefill worker "
        "computes other prompts meanwhile",
    )
