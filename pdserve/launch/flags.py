"""The flags of `pdserve serve`, `pdserve router` and `pdserve worker` as tables of
`pdserve.flags.Flag` (cheap to import): a flag that sets a config field takes its default from
there (`RouterConfig`, `ScalePolicy`; the engine's flags: `engine/cli.py`), and the commands
build those configs back from the same tables. `launch/cli.py` adds them to the parsers."""

from __future__ import annotations

from pdserve import envs
from pdserve.config import DECODE_CHUNK_SIZE
from pdserve.flags import Flag
from pdserve.kv_transfer.registry import TRANSPORTS
from pdserve.protocol.messages import DRAIN_TIMEOUT_S, ROUTER_TIMEOUT_S, TRANSFER_TIMEOUT_S
from pdserve.router.config import MODES, RouterConfig
from pdserve.sim.scale_policy import ScalePolicy

# Tables: a flag per entry, its help wrapped beside it (not one argument per line).
# fmt: off
S = ScalePolicy
SCALE_FLAGS = (  # the autoscaler's timing (`launch.autoscale.make_autoscaler`)
    Flag.of(
        S, "interval_s", f"--autoscale: seconds between decisions (default {S.interval_s:g}); a "
        "pool grows at the first decision that asks for it", name="--scale-interval", metavar="S",
    ),
    Flag.of(
        S, "cooldown_s", "--autoscale: a pool shrinks only once its last change is S seconds old, "
        "and only to the most any decision of the last S seconds asked for (default "
        f"{S.cooldown_s:g}); the workers removed drain first (finish their requests, then leave)",
        name="--scale-cooldown", metavar="S",
    ),
)
R = RouterConfig
ROUTER_CONFIG_FLAGS = (  # `commands.router_config_from_args`
    Flag.of(
        R, "control_host", "bind address of the worker control socket; non-loopback needs "
        "PDSERVE_SECRET",
    ),
    Flag.of(R, "control_port", "control socket port (default: any free)"),
    Flag.of(
        R, "mode", "disagg: prefill and decode pools; colocated: one engine does both",
        choices=MODES,
    ),
    Flag.of(
        R, "local_prefill_threshold", "conditional disaggregation: prompts whose uncached part "
        "is shorter than this many tokens are prefilled on the decode worker while the prefill "
        f"pool is busy (default {R.local_prefill_threshold}); an idle pool takes them, so "
        "decoding streams are not paused",
    ),
    Flag.of(
        R, "lease_s", f"KV lease deadline on decode workers (default {R.lease_s:g} s). A dead "
        "prefill worker is detected by heartbeats much sooner; the lease is the backstop for "
        "lost messages and long prefill queues",
    ),
    Flag.of(R, "heartbeat_timeout_s", "silence before a worker is dead"),
    Flag.of(
        R, "max_inflight", "admission control: requests in flight before new ones get 429 with "
        "Retry-After",
    ),
    Flag.of(
        R, "slo_ttft_s", "SLO-aware admission: answer 429 (with Retry-After) to a new request "
        "when the prompt tokens already queued for prefill, at the workers' measured prefill "
        "speed, would make its time to first token exceed this (default: off)",
        name="--slo-ttft", type=float, metavar="SECONDS",
    ),
    Flag.of(
        R, "slo_tpot_s", "SLO-aware admission: answer 429 when the chosen decode worker's "
        "measured time per output token already exceeds this (default: off). Admitted requests "
        "are never dropped to make room", name="--slo-tpot", type=float, metavar="SECONDS",
    ),
)
KV_PUSH_FLAGS = (  # serve and worker
    Flag(
        "--kv-compression", default="none", choices=("none", "fp8"),
        help="KV on the wire from prefill to decode workers: fp8 (e4m3 with a scale per block) "
        "halves the bytes of a 16-bit cache, for links slower than the CPU; lossy (see "
        "docs/results.md for its effect on outputs); tcp only (default none)",
    ),
    Flag(
        "--kv-push", default="layers", choices=("layers", "whole"),
        help="when a prefill worker sends a prompt's KV: layers (default) sends each layer's "
        "blocks as soon as that layer has computed them (each chunk's, under the next "
        "chunks); whole sends the whole cache once the prompt is computed, the baseline "
        "layer-wise streaming is measured against (benchmarks/network_matrix.py)",
    ),
    Flag(
        "--transfer-timeout-s", float, TRANSFER_TIMEOUT_S, metavar="S",
        help="a prefill worker gives up a KV push that its decode worker has not acknowledged "
        f"S seconds after the prompt was computed (default {TRANSFER_TIMEOUT_S:g}); the decode "
        "worker then prefills the prompt itself. Only that request waits: the prefill worker "
        "computes other prompts meanwhile",
    ),
)


def _drain_flag(what: str) -> Flag:
    return Flag(
        "--drain-timeout-s", float, DRAIN_TIMEOUT_S, metavar="S",
        help=f"on SIGTERM {what} (default {DRAIN_TIMEOUT_S:g}); SIGINT or a second SIGTERM "
        "stops at once",
    )


def router_flags() -> tuple[Flag, ...]:
    """The router's flags (built when registering: --api-key's default is read from the
    environment then)."""
    return (
        _drain_flag("refuse new requests (503 + Retry-After) and let those admitted finish, for "
                    "at most S seconds, then stop with exit status 0"),
        Flag("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)"),
        Flag("--port", int, 8000, "HTTP port (0 = any free port)"),
        *ROUTER_CONFIG_FLAGS,
        Flag(  # RouterConfig.short_prefills_to_idle_pool, inverted
            "--keep-short-prefills-local", action="store_true",
            help="prefill every prompt under --local-prefill-threshold on the decode worker, "
            "even when the prefill pool is idle (lowest TTFT for short prompts, at the cost of "
            "pausing the decode worker's streams while it prefills)",
        ),
        Flag("--api-key", default=envs.api_key(), help="require 'Authorization: Bearer KEY' "
             "(default: $PDSERVE_API_KEY, else none)"),
        Flag(
            "--api-keys", metavar="FILE",
            help="accept these API keys (one 'KEY [REQUESTS_PER_S]' per line; a rate limits "
            "that key: 429 beyond it); each key is a tenant for fair admission under overload",
        ),
        Flag(
            "--max-waiting", int, 64, metavar="N",
            help="at --max-inflight, requests of one tenant that may wait for a turn (fairly: "
            "lowest priority value, then the tenant with the fewest in flight); more: 429",
        ),
        Flag(
            "--queue-timeout", float, 30.0, metavar="SECONDS",
            help="how long a request waits for a turn at --max-inflight before a 429",
        ),
        Flag("--model-name", help="name served in /v1/models (default: file name)"),
        Flag(
            "--request-log", metavar="FILE",
            help="append one JSON line per finished request to FILE: its arrival, each "
            "phase's start and end on the router's clock (queue, decode_wait, prefill_queue, "
            "prefill, transfer, local_prefill, decode), workers, KV bytes, cache hits, outcome "
            "(docs/observability.md); `pdserve bench --request-log FILE` breaks TTFT down "
            "from it",
        ),
        Flag(
            "--otlp-traces-endpoint", metavar="URL", default=envs.otlp_traces_endpoint(),
            help="send OpenTelemetry traces over OTLP to URL, e.g. http://127.0.0.1:4318/v1/"
            "traces (http/protobuf; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc for grpc): a span "
            "per phase of each request on the router and its workers, under an incoming "
            "traceparent (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off; serve hands "
            "it to its workers, a `pdserve worker` reads the variable)",
        ),
        Flag(
            "--chat-template", metavar="NAME|FILE",
            help="chat template for /v1/chat/completions instead of the model's: a Jinja file, "
            "or a shipped one by name (llama3_json_tools: Llama-3 JSON tool calling, for models "
            "whose own template does not render tools)",
        ),
    )

AUTOSCALE_FLAGS = (
    Flag(
        "--autoscale", action="store_true",
        help="size the prefill and decode pools while serving: every --scale-interval the "
        "simulator, calibrated to the workers' measured speeds, predicts TTFT and TPOT p90 of "
        "the observed load for candidate counts, and the pools move to the cheapest that meets "
        "--slo-ttft and --slo-tpot with 20%% headroom (also growing on a measured SLO miss or a "
        "growing prefill queue). --prefill/--decode are the minimums. Admission then refuses "
        "only what the largest allowed pools could not serve",
    ),
    Flag("--max-prefill", int, metavar="N",
         help="--autoscale: most prefill workers (default: --prefill)"),
    Flag("--max-decode", int, metavar="N",
         help="--autoscale: most decode workers (default: --decode)"),
    *SCALE_FLAGS,
)
POOL_FLAGS = (  # serve: how many workers of each kind
    Flag("--prefill", int, 1, "prefill workers (disagg mode, default 1)"),
    Flag("--decode", int, 1, "decode workers (disagg mode, default 1)"),
    *(
        Flag(
            f"--{role}-tp", int, metavar="N",
            help=f"disagg mode: tensor-parallel size of each {role} worker (default: "
            "--tensor-parallel-size). Prefill and decode sizes may differ: the KV heads are "
            "re-sharded on the way (`pdserve plan` recommends a size per phase)",
        )
        for role in ("prefill", "decode")
    ),
    *(
        Flag(
            f"--{role}-ep", int, metavar="N",
            help=f"disagg mode: expert-parallel size of each {role} worker (Mixture-of-Experts; "
            f"default: --expert-parallel-size): N divides its --{role}-tp. The KV transfer is "
            "the same whatever the sizes (attention's heads are what moves)",
        )
        for role in ("prefill", "decode")
    ),
    Flag(
        "--prefill-pp", int, metavar="N",
        help="disagg mode: pipeline-parallel size of each prefill worker: N stages (processes), "
        "each holding consecutive layers (--pp-layer-partition 15,15 to choose) and pushing its "
        "own layers' KV to the decode worker from its own process; with --prefill-tp T each "
        "stage is a group of T ranks; under --launcher ray the stages may span hosts. It pays "
        "across hosts, where each stage brings its own cores and link; on one 2-core machine it "
        "ties with one worker (docs/serving.md). Default 1",
    ),
    Flag(
        "--decode-pp", int, metavar="N",
        help="refused above 1: pipeline parallelism is for the prefill pool (a decode step "
        "through a pipeline pays a hop per stage for every token); use --decode-tp",
    ),
    Flag("--colocated-workers", int, 1, "workers in colocated mode (default 1)"),
)
SERVE_FLAGS = (  # serve: after the pools and autoscaling
    Flag(
        "--decode-chunk-size", int, DECODE_CHUNK_SIZE, metavar="N",
        help="disagg mode: a decode worker computes the prompts it keeps (short ones while the "
        "prefill pool is busy, warm suffixes, migrated streams) at most N tokens per step, its "
        "running streams' tokens included, so those streams keep flowing; with no stream "
        f"running it computes them whole (default {DECODE_CHUNK_SIZE}; 0 = always whole prompts "
        "in one step). Co-located workers use --chunk-size",
    ),
    Flag("--kv-transport", default="tcp", choices=TRANSPORTS, help="KV transfer backend"),
    *KV_PUSH_FLAGS,
    Flag(
        "--startup-timeout-s", float, 300.0,
        "how long the workers may take to register before serve gives up (default 300)",
    ),
    Flag(
        "--launcher", default="local", choices=("local", "ray"),
        help="local: the workers are processes of this machine, pinned to its cores (default); "
        "ray: each worker is a Ray actor on a Ray cluster (--ray-address), placed by "
        "--prefill-resources/--decode-resources and node labels pdserve/role=prefill|decode, "
        "restarted by Ray if it dies (needs pdserve[ray])",
    ),
    Flag(
        "--ray-address", metavar="auto|HOST:PORT",
        help="--launcher ray: the cluster to join (auto: the one `ray start` runs on this "
        "host); none given: start a local one on this machine's cores, as ray.init() does",
    ),
    *(
        flag
        for role in ("prefill", "decode")
        for flag in (
            Flag(
                f"--{role}-resources", metavar="JSON",
                help=f"--launcher ray: the Ray resources of each {role} worker as JSON, e.g. "
                "'{\"CPU\": 2}' or '{\"GPU\": 1}' (default: one CPU, and one GPU when the "
                "cluster has GPUs; its engine gets as many threads as CPUs)",
            ),
            Flag(
                f"--{role}-args", metavar="FLAGS",
                help=f"engine flags for the {role} pool only, either launcher, e.g. "
                + ('"--chunk-size 2048"' if role == "prefill" else '"--max-num-seqs 128"')
                + " (given after the shared ones, so they win)",
            ),
        )
    ),
    Flag(
        "--no-restart", action="store_true",
        help="do not restart a worker that exits (by default it is restarted with a backoff "
        "that doubles per crash, 1 s up to 30 s, and each exit is reported with its last "
        "output); for an outside supervisor such as systemd or Kubernetes",
    ),
    Flag(
        "--kv-store", action="store_true",
        help="also start a KV store (DRAM + SSD tiers) that workers load from and offload to; "
        "block bytes move over --kv-transport (tcp, or nixl: NIXL READs)",
    ),
    Flag(
        "--kv-store-endpoint", metavar="ENDPOINT",
        help="use an existing `pdserve store` at tcp://HOST:PORT (or nixl://HOST:PORT, a store "
        "started with --transport nixl), or a Mooncake Store pool at mooncake://MASTER:PORT "
        "(docs/serving.md), instead of starting one",
    ),
    Flag(
        "--kv-store-backend", choices=("pdserve", "mooncake"), default="pdserve",
        help="what --kv-store starts: `pdserve store` (one process, DRAM + SSD; the default) or "
        "a loopback mooncake_master whose Mooncake Store pool every worker contributes "
        "--store-dram-gb of DRAM to (a one-host trial: for a cluster, run mooncake_master "
        "yourself and give --kv-store-endpoint mooncake://HOST:PORT; needs pdserve[mooncake])",
    ),
    Flag("--store-dir", help="SSD tier directory (default: a temporary directory)"),
    Flag("--store-dram-gb", float, 1.0, "store DRAM tier size (default 1)"),
    Flag("--store-ssd-gb", float, 4.0, "store SSD tier size (default 4)"),
    Flag(
        "--step-log", metavar="DIR",
        help="every worker appends one JSON line per engine step (start, seconds, batch shape) "
        "to DIR/steps-ROLE-PID.jsonl; `pdserve profile --from-steps DIR` calibrates the "
        "simulator from them (same as PDSERVE_STEP_LOG=DIR)",
    ),
)
WORKER_FLAGS = (
    Flag("--role", choices=("prefill", "decode", "both"), required=True),
    Flag(
        "--router", action="append", required=True,
        help="the router's control endpoint, tcp://HOST:PORT. Repeat it to serve two or more "
        "routers at once (active-active: a load balancer in front of them fails over); each "
        "request's messages go to the router that placed it, heartbeats to all",
    ),
    Flag("--worker-id", help="stable id (a restarted worker re-registers under it)"),
    Flag("--cpus", help="pin to these cores, e.g. 0 or 2-3 (threads follow)"),
    Flag("--kv-transport", default="tcp", choices=TRANSPORTS),
    *KV_PUSH_FLAGS,
    _drain_flag("take nothing new (the routers are told), finish the requests this worker "
                "holds, then exit 0; past S seconds exit anyway and the routers migrate what is "
                "left"),
    Flag(
        "--router-timeout-s", float, ROUTER_TIMEOUT_S,
        help="silence from the router (no answer to this worker's heartbeats) after which the "
        "worker drops the requests the router placed on it and frees their blocks, then "
        f"registers again when a router speaks (default {ROUTER_TIMEOUT_S:g})",
    ),
    Flag("--kv-host", default="127.0.0.1", help="address the KV receiver binds (decode role)"),
    Flag(
        "--kv-store", metavar="ENDPOINT",
        help="a `pdserve store` endpoint (tcp://HOST:PORT, or nixl://HOST:PORT: block bytes by "
        "NIXL READs), or a Mooncake Store pool (mooncake://MASTER:PORT[?replicas=N&prefer="
        "SEGMENT&segment_mb=M&buffer_mb=B&host=ADDR&metrics_port=P], docs/serving.md): load "
        "cached prefixes from it and offload finished requests' blocks to it",
    ),
)
# fmt: on
