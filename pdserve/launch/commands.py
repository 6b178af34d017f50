"""What `pdserve serve`, `pdserve router` and `pdserve worker` do, given their parsed flags
(`launch/cli.py`). Heavy imports (torch, the router app) happen inside each command.

A little over 300 lines: `serve` starts the router, its workers, a KV store and the autoscaler
in one order that reads best in one function (its workers' argv are built by the helpers here).
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

from pdserve import envs, tracing
from pdserve.config import EngineConfig
from pdserve.engine.cli import ENGINE_FLAGS
from pdserve.flags import config_values
from pdserve.launch.flags import ROUTER_CONFIG_FLAGS
from pdserve.router.config import RouterConfig

# set per worker by serve (its pool's chunk size; threads follow its cores), never forwarded
PER_WORKER_FLAGS = ("--chunk-size", "--threads", "--pp-layer-partition")


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router's settings from the flags `launch.cli` adds (--block-size: the engine's)."""
    autoscale_max = None
    if getattr(args, "autoscale", False):
        autoscale_max = (max(args.prefill, args.max_prefill or 0),
                         max(args.decode, args.max_decode or 0))  # fmt: skip
    return RouterConfig(
        **config_values(args, ROUTER_CONFIG_FLAGS),
        short_prefills_to_idle_pool=not args.keep_short_prefills_local,
        block_size=args.block_size,
        autoscale_max=autoscale_max,
    )


def make_frontend(args):
    from pdserve.model.loader import load_model_config, load_tokenizer
    from pdserve.model.tokenizer import load_chat_template
    from pdserve.protocol.channel import require_secret_for, resolve_secret
    from pdserve.router.core import RouterCore
    from pdserve.router.fairness import RateLimits
    from pdserve.router.frontend import Frontend
    from pdserve.router.metrics import register_workers

    tracing.setup("pdserve-router", args.otlp_traces_endpoint)
    secret = resolve_secret()
    require_secret_for(args.control_host, secret)
    path, _ = load_model_config(args.model)
    core = RouterCore(router_config_from_args(args), secret)
    name = args.model_name or path.name.removesuffix(".gguf")
    register_workers(core, name)
    tokenizer = load_tokenizer(args.model)
    if args.chat_template:
        tokenizer = tokenizer.with_chat_template(load_chat_template(args.chat_template))
    if args.max_waiting < 0 or not args.queue_timeout > 0:
        raise ValueError("--max-waiting must be >= 0 and --queue-timeout > 0")
    limits = RateLimits.from_file(args.api_keys) if args.api_keys else None
    request_log = None
    if args.request_log:
        from pdserve.router.request_log import RequestLog

        request_log = RequestLog(args.request_log)
    return Frontend(
        core,
        tokenizer,
        name,
        api_key=args.api_key,
        limits=limits,
        max_waiting=args.max_waiting,
        queue_timeout_s=args.queue_timeout,
        request_log=request_log,
    )


def router(args) -> int:
    """`pdserve router`: the router alone; workers join with `pdserve worker`."""
    from pdserve.launch.local import serve_forever
    from pdserve.router.app import build_app

    frontend = make_frontend(args)

    async def ready(port):
        print(
            f"router on http://{args.host}:{port}/v1, workers connect to {frontend.core.endpoint}",
            flush=True,
        )

    return serve_forever(
        build_app(frontend), args.host, args.port, on_ready=ready,
        drain=lambda: frontend.drain(args.drain_timeout_s),
    )  # fmt: skip


def engine_argv(args) -> list[str]:
    """The engine flags serve gives every worker: those set (a default of None is left to the
    worker), but for `PER_WORKER_FLAGS`."""
    argv = []
    for flag in ENGINE_FLAGS:
        value = getattr(args, flag.dest)
        if flag.name in PER_WORKER_FLAGS or value is None or value is False:
            continue
        argv += [flag.name] if value is True else [flag.name, str(value)]
    return argv


def phase_argv(text: str | None, flag: str) -> list[str]:
    """One pool's own worker flags (`--prefill-args "--chunk-size 1024"`), checked now by
    `pdserve worker`'s own parser (they are appended to its command line)."""
    import shlex

    from pdserve.cli import build_parser

    argv = shlex.split(text or "")
    try:
        _, unknown = build_parser().parse_known_args(
            ["worker", "--role", "decode", "--router", "tcp://127.0.0.1:1", *argv]
        )
    except SystemExit as exc:
        raise ValueError(f"{flag} {text!r}: not valid engine flags") from exc
    if unknown:
        raise ValueError(f"{flag}: {' '.join(unknown)} is not an engine flag (see `pdserve worker "
                         "--help`)")  # fmt: skip
    return argv


def pool_worker_argv(
    base_argv: list[str],
    role: str,
    args,
    tp: int,
    pool_argv: list[str],
    device: str | None,
    ep: int = 1,
    pp: int = 1,
) -> list[str]:
    """The engine flags of a worker of `role`, at start-up and when the autoscaler grows its
    pool alike: the shared ones, its device, its pool's chunk size, TP, EP and PP (the
    partition, pipelined), then the pool's own
    `--prefill-args` / `--decode-args` last, so that they win (its threads, weight format,
    device: the pool's hardware)."""
    argv = list(base_argv)
    if device:  # given last, it overrides the --device of base_argv
        argv += ["--device", device]
    chunk = {"both": args.chunk_size, "decode": args.decode_chunk_size}.get(role)
    if chunk is not None:  # 0 too: whole prompts (a worker's default is WORKER_CHUNK_SIZE)
        argv += ["--chunk-size", str(chunk)]
    argv += ["--tensor-parallel-size", str(tp), "--expert-parallel-size", str(ep)]
    argv += ["--pipeline-parallel-size", str(pp)]
    if pp > 1 and args.pp_layer_partition:  # the pipelined pool's alone
        argv += ["--pp-layer-partition", args.pp_layer_partition]
    return [*argv, *pool_argv]


def tensor_parallel_sizes(args, kind: str = "tp") -> dict[str, int]:
    """Each role's tensor-parallel size: --prefill-tp / --decode-tp, else
    --tensor-parallel-size (kind "ep": the expert-parallel sizes, alike)."""
    default = (args.tensor_parallel_size if kind == "tp" else args.expert_parallel_size) or 1
    prefill, decode = getattr(args, f"prefill_{kind}"), getattr(args, f"decode_{kind}")
    sizes = {"both": default, "prefill": prefill or default, "decode": decode or default}
    whole = "--tensor-parallel-size" if kind == "tp" else "--expert-parallel-size"
    if args.mode != "disagg" and (prefill or decode):
        raise ValueError(f"--prefill-{kind}/--decode-{kind} size the pools of --mode disagg; "
                         f"co-located workers take {whole}")  # fmt: skip
    for flag, size in ((f"--prefill-{kind}", prefill), (f"--decode-{kind}", decode)):
        if size is not None and size < 1:
            raise ValueError(f"{flag} must be >= 1, got {size}")
    return sizes


def pipeline_sizes(args) -> dict[str, int]:
    """Each role's pipeline-parallel size: --prefill-pp for the prefill pool, else
    --pipeline-parallel-size for co-located workers; decode workers take none (refused by
    name). A partition (--pp-layer-partition) is checked against the model before any worker
    starts, as every size is."""
    if (args.decode_pp or 1) != 1:
        raise ValueError(
            f"--decode-pp {args.decode_pp}: pipeline parallelism is for the prefill pool; a decode "
            "step through a pipeline pays a hop per stage for every token. Give the decode "
            "pool --decode-tp instead"
        )
    whole, prefill = args.pipeline_parallel_size or 1, args.prefill_pp
    if args.mode != "disagg" and prefill:
        raise ValueError("--prefill-pp sizes the prefill pool of --mode disagg; co-located "
                         "workers take --pipeline-parallel-size")  # fmt: skip
    if args.mode == "disagg" and whole > 1:
        raise ValueError("in --mode disagg the prefill pool's pipeline is --prefill-pp N "
                         "(decode workers take none), not --pipeline-parallel-size")  # fmt: skip
    if prefill is not None and prefill < 1:
        raise ValueError(f"--prefill-pp must be >= 1, got {prefill}")
    sizes = {"both": whole, "prefill": prefill or 1, "decode": 1}
    if args.pp_layer_partition and max(sizes.values()) == 1:
        raise ValueError("--pp-layer-partition splits the layers of a pipeline: add "
                         "--prefill-pp N (disagg) or --pipeline-parallel-size N")  # fmt: skip
    return sizes


def check_pipelines(args, tp: dict[str, int], pp: dict[str, int]) -> None:
    """Refuse now, by name, what each pipelined pool's workers would refuse as they start:
    more stages than layers, a partition that does not add up, the KV store with stages Ray
    places or with TP x PP (`serving/build.py` `check_store`), TP x PP under Ray."""
    for role, size in pp.items():
        if size > 1 and args.kv_store and (args.launcher == "ray" or tp[role] > 1):
            raise ValueError(
                "--kv-store with --prefill-pp under --launcher ray or with TP stages: the "
                "store link moves every layer from stage 0's process, which reaches the other "
                "stages' caches only when they are its host's single-rank processes; drop one "
                "of them"
            )
        if size > 1 and tp[role] > 1 and args.launcher == "ray":
            raise ValueError(
                "--prefill-pp with --prefill-tp under --launcher ray: a stage of several ranks "
                "is not placed by Ray yet (its ranks would need bundles on the stage's node); "
                "use --launcher local, or one of the two"
            )
        if size > 1:  # the model's file read only here: a pipeline's flags need its layers
            from pdserve.engine.pp.stages import stage_layers
            from pdserve.model.loader import load_model_config

            EngineConfig(role=role, tensor_parallel_size=tp[role], pipeline_parallel_size=size,
                         pp_layer_partition=args.pp_layer_partition)  # fmt: skip
            stage_layers(load_model_config(args.model)[1].num_layers, size,
                         args.pp_layer_partition)  # fmt: skip


def serve(args) -> int:
    """`pdserve serve`: the router, then its workers (and a KV store) as subprocesses."""
    from pdserve.launch.local import (
        ServePlan,
        gpu_per_worker,
        serve_forever,
        visible_gpus,
        wait_ready,
    )
    from pdserve.launch.procs import WorkerProcs
    from pdserve.router.app import build_app

    max_seqs = args.max_num_seqs or EngineConfig.max_num_seqs  # the engine's default
    if args.decode_chunk_size and not args.decode_chunk_size >= max_seqs:
        raise ValueError(
            f"--decode-chunk-size must be 0 (off) or at least --max-num-seqs ({max_seqs}): every "
            f"running stream needs one of its tokens in each step, got {args.decode_chunk_size}"
        )
    if args.step_log:  # the workers inherit it (pdserve.envs.step_log_dir)
        os.environ[envs.STEP_LOG] = str(Path(args.step_log).resolve())
    if args.otlp_traces_endpoint:  # so do they this (pdserve.envs.otlp_traces_endpoint)
        os.environ[envs.OTLP_TRACES_ENDPOINT] = args.otlp_traces_endpoint
    from pdserve.serving.worker_config import (
        check_kv_compression,
        check_tensor_parallel,
    )

    tp, ep = tensor_parallel_sizes(args), tensor_parallel_sizes(args, "ep")
    for role, size in ep.items():  # refused now, by name, not in each worker as it starts
        EngineConfig(tensor_parallel_size=tp[role], expert_parallel_size=size)
        if size > 1:
            from pdserve.engine.tp.shard import TPShard
            from pdserve.model.loader import load_model_config

            TPShard(0, tp[role], size).check(load_model_config(args.model)[1])
    pp = pipeline_sizes(args)
    check_pipelines(args, tp, pp)
    procs_per_worker = {role: tp[role] * pp[role] for role in tp}  # ranks x stages
    cores = sorted(os.sched_getaffinity(0))
    plan = ServePlan.make(args.mode, args.prefill, args.decode, args.colocated_workers, cores,
                          procs_per_worker)  # fmt: skip
    check_kv_compression(args.kv_compression, args.kv_transport, args.kv_cache_dtype)
    if args.kv_store_backend != "pdserve" and not args.kv_store:
        raise ValueError(
            f"--kv-store-backend {args.kv_store_backend} chooses what --kv-store starts: add "
            "--kv-store, or give a running pool with --kv-store-endpoint mooncake://HOST:PORT"
        )
    for size in tp.values():
        check_tensor_parallel(size, args.kv_store or args.kv_store_endpoint)
    role_argv = {"prefill": phase_argv(args.prefill_args, "--prefill-args"),
                 "decode": phase_argv(args.decode_args, "--decode-args")}  # fmt: skip
    role_argv["both"] = role_argv["decode"]
    autoscaler = None
    if args.autoscale:
        from pdserve.launch.autoscale import make_autoscaler
        from pdserve.model.loader import load_model_config

        autoscaler = make_autoscaler(args, load_model_config(args.model)[1])
    elif args.max_prefill is not None or args.max_decode is not None:
        raise ValueError("--max-prefill/--max-decode bound the autoscaler: add --autoscale")
    frontend = make_frontend(args)
    if args.launcher == "ray":
        from pdserve.kv_transfer.wire import is_loopback
        from pdserve.launch.ray_launcher import RayWorkers, parse_resources

        pools = {r: parse_resources(getattr(args, f"{r}_resources"), f"--{r}-resources")
                 for r in ("prefill", "decode")}  # fmt: skip
        public = not is_loopback(args.control_host)
        procs = RayWorkers(args.ray_address, pools, public, restart=not args.no_restart)
    else:
        procs = WorkerProcs(restart=not args.no_restart)
    base_argv = engine_argv(args)

    store_endpoint = args.kv_store_endpoint
    if args.kv_store and not store_endpoint:
        store_endpoint = procs.start_store(
            args.store_dir, args.store_dram_gb, args.store_ssd_gb, args.kv_transport,
            args.kv_store_backend,
        )  # fmt: skip
    if store_endpoint:
        base_argv += ["--kv-store", store_endpoint]
    base_argv += ["--transfer-timeout-s", str(args.transfer_timeout_s)]
    base_argv += ["--kv-compression", args.kv_compression, "--kv-push", args.kv_push]
    base_argv += ["--drain-timeout-s", str(args.drain_timeout_s)]

    gpus = visible_gpus() if args.device in ("auto", "cuda") and args.launcher == "local" else 0
    devices = gpu_per_worker(args.device, len(plan.workers), gpus)
    if gpus == 1 and args.mode == "disagg":
        print(
            "pdserve serve: note: the prefill and decode workers share this machine's one GPU, "
            "where a prefill still stalls the decode steps and each transfer costs a copy "
            "through host memory; disaggregation pays with a GPU per worker (--mode colocated "
            "serves one GPU better)",
            flush=True,
        )

    def launch(i: int, role: str, cpus: str, device: str | None) -> str:
        argv = pool_worker_argv(base_argv, role, args, tp[role], role_argv[role], device, ep[role],
                                pp[role])  # fmt: skip
        procs.start(f"{role}-{i}", role, cpus, frontend.core.endpoint, argv, args.kv_transport,
                    procs_per_worker[role], pp[role])  # fmt: skip
        return f"{role}-{i}"

    def add_worker(role: str) -> str:
        """The autoscaler's new worker: the next index; on this machine it shares the cores
        of its pool's first worker (a GPU each in turn when there are several)."""
        i = next(indices)
        cpus = next((c for r, c in plan.workers if r == role), plan.workers[0][1])
        return launch(i, role, cpus, gpu_per_worker(args.device, i + 1, gpus)[i])

    indices = itertools.count(len(plan.workers))

    async def ready(port):
        for i, (role, cpus) in enumerate(plan.workers):
            launch(i, role, cpus, devices[i])
        n_pre = sum(r == "prefill" for r, _ in plan.workers)
        try:
            await wait_ready(
                frontend.core, procs, n_pre, len(plan.workers) - n_pre, args.startup_timeout_s
            )
        except RuntimeError as exc:
            print(f"pdserve serve: error: {exc}", flush=True)
            return False  # uvicorn stops, serve exits 1; on_stop stops the other workers
        procs.forward_output()
        if autoscaler is not None:
            from pdserve.launch.autoscale import AutoscaleLoop

            AutoscaleLoop(frontend, autoscaler, add_worker, procs.drain,
                          args.startup_timeout_s).run()  # fmt: skip
        url = f"http://{args.host}:{port}"
        layout = ", ".join(
            (f"{r}@ray" if args.launcher == "ray" else f"{r}@cpu{c}") + (f"+{d}" if d else "")
            for (r, c), d in zip(plan.workers, devices, strict=True)
        )
        if autoscaler is not None:
            b = autoscaler.policy.bounds
            layout += (f"; autoscaling {b.min_prefill}-{b.max_prefill}P, "
                       f"{b.min_decode}-{b.max_decode}D")  # fmt: skip
        print(f"pdserve ready: {url}/v1 ({args.mode}: {layout})", flush=True)
        print(
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            "-d '"
            + '{"messages": [{"role": "user", "content": '
            + '"What is the capital of France? Answer in one sentence."}]}'
            + "'",
            flush=True,
        )

    return serve_forever(
        build_app(frontend), args.host, args.port, on_ready=ready, on_stop=procs.stop,
        drain=lambda: frontend.drain(args.drain_timeout_s),
    )  # fmt: skip


def worker(args) -> int:
    """`pdserve worker`: one engine process that joins a router."""
    from pdserve.launch.local import config_error, pin_cpus, run_worker, worker_config

    n = pin_cpus(args.cpus)
    try:
        config = worker_config(args, threads=args.threads or n)
    except (ValueError, FileNotFoundError) as exc:  # a restart would not fix them
        return config_error(exc)
    return run_worker(config)
