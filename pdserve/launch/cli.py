"""`pdserve serve`, `pdserve router` and `pdserve worker`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pdserve import envs
from pdserve.config import DECODE_CHUNK_SIZE, EngineConfig
from pdserve.engine.cli import add_engine_args, engine_config_from_args
from pdserve.kv_transfer.registry import TRANSPORTS
from pdserve.router.config import MODES, RouterConfig

ENGINE_FLAGS = (
    "model",
    "dtype",
    "device",
    "weights",
    "kv_cache_gb",
    "block_size",
    "max_num_seqs",
    "max_model_len",
)


def _router_args(p: argparse.ArgumentParser) -> None:
    """The router's flags; their defaults are `RouterConfig`'s (its class attributes)."""
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
        "--model-name", default=None, help="name served in /v1/models (default: file name)"
    )


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router's settings from the flags `_router_args` (and the engine's --block-size) add."""
    return RouterConfig(
        control_host=args.control_host,
        control_port=args.control_port,
        mode=args.mode,
        local_prefill_threshold=args.local_prefill_threshold,
        short_prefills_to_idle_pool=not args.keep_short_prefills_local,
        lease_s=args.lease_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        block_size=args.block_size,
        max_inflight=args.max_inflight,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
    )


def _make_frontend(args):
    from pdserve.model.loader import load_model_config, load_tokenizer
    from pdserve.protocol.channel import require_secret_for, resolve_secret
    from pdserve.router.core import RouterCore
    from pdserve.router.frontend import Frontend
    from pdserve.router.metrics import register_workers

    secret = resolve_secret()
    require_secret_for(args.control_host, secret)
    path, _ = load_model_config(args.model)
    core = RouterCore(router_config_from_args(args), secret)
    register_workers(core)
    name = args.model_name or path.name.removesuffix(".gguf")
    return Frontend(core, load_tokenizer(args.model), name, api_key=args.api_key)


def _router(args) -> int:
    from pdserve.launch.local import serve_forever
    from pdserve.router.app import build_app

    frontend = _make_frontend(args)

    async def ready(port):
        print(
            f"router on http://{args.host}:{port}/v1, workers connect to {frontend.core.endpoint}",
            flush=True,
        )

    return serve_forever(build_app(frontend), args.host, args.port, on_ready=ready)


def _engine_argv(args) -> list[str]:
    argv = []
    for flag in ENGINE_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    if args.enforce_eager:
        argv.append("--enforce-eager")
    return argv


def _serve(args) -> int:
    from pdserve.launch.local import (
        ServePlan,
        WorkerProcs,
        drain_worker_output,
        gpu_per_worker,
        serve_forever,
        visible_gpus,
        wait_ready,
    )
    from pdserve.router.app import build_app

    max_seqs = args.max_num_seqs or EngineConfig.max_num_seqs  # the engine's default
    if args.decode_chunk_size and not args.decode_chunk_size >= max_seqs:
        raise ValueError(
            f"--decode-chunk-size must be 0 (off) or at least --max-num-seqs ({max_seqs}): every "
            f"running stream needs one of its tokens in each step, got {args.decode_chunk_size}"
        )
    if args.step_log:  # the workers inherit it (pdserve.envs.step_log_dir)
        os.environ[envs.STEP_LOG] = str(Path(args.step_log).resolve())
    cores = sorted(os.sched_getaffinity(0))
    plan = ServePlan.make(args.mode, args.prefill, args.decode, args.colocated_workers, cores)
    frontend = _make_frontend(args)
    procs = WorkerProcs()
    base_argv = _engine_argv(args)

    store_endpoint = args.kv_store_endpoint
    if args.kv_store and not store_endpoint:
        store_endpoint = procs.start_store(
            args.store_dir, args.store_dram_gb, args.store_ssd_gb, args.kv_transport
        )
    if store_endpoint:
        base_argv += ["--kv-store", store_endpoint]

    gpus = visible_gpus() if args.device in ("auto", "cuda") else 0
    devices = gpu_per_worker(args.device, len(plan.workers), gpus)
    if gpus == 1 and args.mode == "disagg":
        print(
            "pdserve serve: note: the prefill and decode workers share this machine's one GPU, "
            "where a prefill still stalls the decode steps and each transfer costs a copy "
            "through host memory; disaggregation pays with a GPU per worker (--mode colocated "
            "serves one GPU better)",
            flush=True,
        )

    async def ready(port):
        for i, (role, cpus) in enumerate(plan.workers):
            argv = list(base_argv)
            if devices[i]:  # given last, it overrides the --device of base_argv
                argv += ["--device", devices[i]]
            chunk = {"both": args.chunk_size, "decode": args.decode_chunk_size}.get(role)
            if chunk:
                argv += ["--chunk-size", str(chunk)]
            procs.start(f"{role}-{i}", role, cpus, frontend.core.endpoint, argv, args.kv_transport)
        n_pre = sum(r == "prefill" for r, _ in plan.workers)
        try:
            await wait_ready(
                frontend.core, procs, n_pre, len(plan.workers) - n_pre, args.startup_timeout_s
            )
        except RuntimeError as exc:
            print(f"pdserve serve: error: {exc}", flush=True)
            os.kill(os.getpid(), 2)  # stop uvicorn; on_stop stops the other workers
            return
        drain_worker_output(procs)
        url = f"http://{args.host}:{port}"
        layout = ", ".join(
            f"{r}@cpu{c}" + (f"+{d}" if d else "")
            for (r, c), d in zip(plan.workers, devices, strict=True)
        )
        print(f"pdserve ready: {url}/v1 ({args.mode}: {layout})", flush=True)
        print(
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            "-d '"
            + '{"messages": [{"role": "user", "content": "What is the capital of France?"}]}'
            + "'",
            flush=True,
        )

    return serve_forever(
        build_app(frontend), args.host, args.port, on_ready=ready, on_stop=procs.stop
    )


def _worker(args) -> int:
    from pdserve.launch.local import pin_cpus, run_worker
    from pdserve.serving.worker import WorkerConfig

    n = pin_cpus(args.cpus)
    threads = args.threads or n
    engine = engine_config_from_args(args, role=args.role)
    if threads:
        from dataclasses import replace

        engine = replace(engine, num_threads=threads)
    if args.role == "prefill":  # a prefill worker computes whole prompts: no chunking
        from dataclasses import replace

        engine = replace(engine, chunk_size=None)
    config = WorkerConfig(
        kv_store=args.kv_store,
        engine=engine,
        router=args.router,
        worker_id=args.worker_id or f"{args.role}-{os.getpid()}",
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
    )
    return run_worker(config)


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
    p.add_argument(
        "--colocated-workers", type=int, default=1, help="workers in colocated mode (default 1)"
    )
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
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
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
    p.set_defaults(func=_serve)

    p = sub.add_parser("router", help="start only the router (workers join with `pdserve worker`)")
    _router_args(p)
    add_engine_args(p)
    p.set_defaults(func=_router)

    p = sub.add_parser(
        "worker",
        help="start one engine worker that joins a router",
        description="One engine process with a role. It registers with the router, "
        "heartbeats, and serves requests the router places on it.",
    )
    p.add_argument("--role", choices=["prefill", "decode", "both"], required=True)
    p.add_argument("--router", required=True, help="the router's control endpoint, tcp://HOST:PORT")
    p.add_argument(
        "--worker-id", default=None, help="stable id (a restarted worker re-registers under it)"
    )
    p.add_argument(
        "--cpus", default=None, help="pin to these cores, e.g. 0 or 2-3 (threads follow)"
    )
    p.add_argument("--kv-transport", default="tcp", choices=TRANSPORTS)
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
    p.set_defaults(func=_worker)
