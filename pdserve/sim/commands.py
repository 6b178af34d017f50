"""Handlers of `pdserve kv-size | profile | simulate | plan` (parsers live in `cli.py`).

Over 300 lines on purpose: the four handlers share one mapping from flags to a `Cluster`,
`Workload` and `Deployment` (`cluster_of`, `workload_of`, `deployment_of`), kept beside them.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from pdserve.bench.metrics import SLO, summarize_by_class
from pdserve.bench.workload import LengthDist, Workload, generate_requests, named_workload
from pdserve.sim.deployment import Cluster, Deployment, Device
from pdserve.sim.hardware import GPUS, Accelerator, Link, get_gpu, get_link
from pdserve.sim.kvmath import dtype_bits, kv_dtype_of
from pdserve.sim.latency import Efficiency
from pdserve.sim.models import get_model
from pdserve.sim.simulator import simulate as run_simulation


def kv_size(args: argparse.Namespace) -> int:
    from pdserve.sim.kvsize import kv_size_report, links_for

    links = links_for(args.link, args.bandwidth_gbps)
    print(kv_size_report(get_model(args.model), args.prompt_tokens, args.dtype, links))
    return 0


def profile(args: argparse.Namespace) -> int:
    from pdserve.sim.calibration import measure_cpu, profile_document
    from pdserve.sim.hardware import Accelerator
    from pdserve.sim.profile import DEFAULT_DECODE, DEFAULT_PREFILL, engine_profile

    if args.from_steps:
        return _profile_from_steps(args)
    if args.decode_steps < 1 or args.repeats < 1:
        raise ValueError("--decode-steps and --repeats must be >= 1")
    import torch

    from pdserve.engine.model_runner import resolve_dtype

    engine_dtype = resolve_dtype(args.dtype or "auto", torch.device("cpu"))
    hardware = measure_cpu(args.threads, dtype=str(engine_dtype).removeprefix("torch."))
    prefill, decode, repeats = DEFAULT_PREFILL, DEFAULT_DECODE, args.repeats
    if args.quick:
        prefill, decode, repeats = ((1, 16), (1, 64)), ((1, 32), (4, 32)), 1
    points, spec, dtype, fit = engine_profile(
        args.model, args.dtype, args.threads, Accelerator.from_profile(hardware), prefill,
        decode, args.decode_steps, repeats, getattr(args, "weights", "auto"),
    )  # fmt: skip
    doc = profile_document(hardware, spec, dtype, points, fit, args.decode_steps)
    Path(args.out).write_text(json.dumps(doc, indent=2))
    print(f"hardware  {hardware['description']}: {hardware['peak_flops'] / 1e9:.1f} GFLOP/s, "
          f"{hardware['mem_bytes_per_s'] / 1e9:.1f} GB/s memory, "
          f"{hardware['loopback_bytes_per_s'] / 1e9:.2f} GB/s loopback TCP")  # fmt: skip
    for pt in points:
        print(f"  {pt.phase:<8} batch {pt.batch_size:>3} x {pt.tokens:>4} tokens: "
              f"{pt.seconds * 1e3:8.1f} ms")  # fmt: skip
    _print_fit(fit)
    if args.serving_url:
        _profile_serving(args)
    print(f"wrote     {args.out}")
    return 0


def _print_fit(fit) -> None:
    eff = fit.efficiency
    print(f"fit       mfu {eff.mfu:.3f} (half at {eff.half_tokens:g} tokens), mbu {eff.mbu:.3f}, "
          f"attention {eff.attn_eff:.3f}, overhead {eff.iteration_overhead_s * 1e3:.2f} ms + "
          f"{eff.per_seq_overhead_s * 1e3:.2f} ms/seq + {eff.per_cached_token_s * 1e6:.2f} "
          f"us/cached token; error median {fit.median_rel_error:.1%}, "
          f"max {fit.max_rel_error:.1%}")  # fmt: skip


def _profile_from_steps(args: argparse.Namespace) -> int:
    """Refit the profile at --out to the steps a served engine logged (`pdserve.sim.served`)."""
    from pdserve.sim.served import refit_profile

    fit, steps = refit_profile(args.out, args.from_steps)
    print(f"steps     {steps} served steps from {args.from_steps}")
    _print_fit(fit)
    if args.serving_url:
        _profile_serving(args)
    print(f"wrote     {args.out}")
    return 0


def _profile_serving(args: argparse.Namespace) -> None:
    """Fit the serving path's overhead against the idle server at --serving-url and add it to
    the profile just written (see `pdserve.sim.overhead`)."""
    from pdserve.sim.calibration import load_profile, save_overhead
    from pdserve.sim.overhead import describe_overhead, fit_overhead, measure_probes, probe_groups

    cluster = load_profile(args.out).cluster(serving=False)
    groups = measure_probes(args.serving_url, probe_groups())
    fit = fit_overhead(cluster, Deployment.served(args.serving_mode), groups)
    save_overhead(args.out, args.serving_mode, fit)
    print(f"serving   {args.serving_mode} at {args.serving_url}: {describe_overhead(fit)}")


def cluster_of(args: argparse.Namespace) -> Cluster:
    """Model, device, link, efficiencies and dtypes from the shared options."""
    prof = None
    if args.profile:
        from pdserve.sim.calibration import load_profile

        prof = load_profile(args.profile)
    gpu = _base_gpu(args)
    if gpu == "cpu" and prof is None:
        raise ValueError("--gpu cpu needs --profile PATH (create it with `pdserve profile`)")
    accel = prof.accelerator if gpu == "cpu" else get_gpu(gpu)
    if args.model is None and prof is None:
        raise ValueError("give --model (a preset name or a HF config.json path)")
    model = get_model(args.model) if args.model else prof.model
    eff = prof.efficiency if prof else Efficiency()
    weight_dtype = prof.weight_dtype if prof and args.dtype == "bf16" else args.dtype
    dtype_bits(weight_dtype)  # validates
    # The serving path's overhead was measured on this machine: it applies to it alone.
    serving = prof.serving if gpu == "cpu" else {}
    figures = _figures(args)
    accel = _priced(accel, gpu, figures)
    link = _link_of(args, prof)
    base = Cluster(model, accel, figures["link"].get(accel.name, link), eff, weight_dtype,
                   args.kv_dtype or kv_dtype_of(weight_dtype), serving,
                   getattr(args, "kv_compression", "none"))  # fmt: skip
    names = [*pool_gpus(args, "prefill"), *pool_gpus(args, "decode"), gpu]
    devices = {n: _device(base, n, prof, args, figures) for n in dict.fromkeys(names) if n}
    known = {*devices, *(d.accel.name for d in devices.values())}
    for flag, field in (("--gpu-cost", "cost_per_hour"), ("--gpu-power", "power_w"),
                        ("--gpu-link", "link")):  # fmt: skip
        unused = sorted(set(figures[field]) - known)
        if unused:
            raise ValueError(f"{flag} names {', '.join(unused)}, which no pool runs on (the "
                             f"devices here: {', '.join(sorted(known))})")  # fmt: skip
    return replace(base, devices=devices)


def _base_gpu(args: argparse.Namespace) -> str:
    return (args.gpu or ("cpu" if args.profile else "h100")).lower()


def pool_gpus(args: argparse.Namespace, pool: str) -> list[str]:
    """The devices given for `pool` ("prefill" or "decode"): `--prefill-gpu a100,h100`."""
    text = getattr(args, f"{pool}_gpu", None)
    return [n.strip().lower() if not n.strip().endswith(".json") else n.strip()
            for n in (text or "").split(",") if n.strip()]  # fmt: skip


def _figures(args: argparse.Namespace) -> dict[str, dict]:
    from pdserve.sim.hardware import parse_figures

    return {
        "cost_per_hour": parse_figures(getattr(args, "gpu_cost", None), "--gpu-cost"),
        "power_w": parse_figures(getattr(args, "gpu_power", None), "--gpu-power"),
        "link": {k: get_link(v) for k, v in _pairs(getattr(args, "gpu_link", None))},
    }


def _pairs(text: str | None) -> list[tuple[str, str]]:
    out = []
    for item in (text or "").split(","):
        if item.strip():
            name, eq, value = item.partition("=")
            if not eq or not name.strip() or not value.strip():
                raise ValueError(f"--gpu-link: {item.strip()!r} is not DEVICE=LINK "
                                 "(e.g. --gpu-link a100-80gb=ib-hdr,h100=ib-ndr)")  # fmt: skip
            out.append((get_gpu(name).name if name.strip().lower() in _PRESET_NAMES
                        else name.strip(), value.strip()))  # fmt: skip
    return out


_PRESET_NAMES = ("h100", "a100", *GPUS)


def _priced(accel: Accelerator, key: str, figures: dict[str, dict]) -> Accelerator:
    """`accel` with the --gpu-cost / --gpu-power figures given for it (by preset or key)."""
    change = {field: by[name] for field in ("cost_per_hour", "power_w")
              for by in [figures[field]] for name in (accel.name, key) if name in by}  # fmt: skip
    return replace(accel, **change) if change else accel


def _device(base: Cluster, name: str, prof, args, figures: dict[str, dict]) -> Device:
    """The hardware a pool names: a GPU preset, "cpu" (the --profile's machine) or a profile
    JSON path (a machine or worker configuration `pdserve profile` measured: its speed,
    efficiencies and weight format)."""
    from pdserve.sim.calibration import load_profile

    if name.endswith(".json"):
        own = load_profile(name)
        link = own.loopback() if args.link.lower() == "loopback" else base.link
        dev = Device(own.accelerator, own.efficiency, own.weight_dtype, link)
    elif name == "cpu":
        if prof is None:
            raise ValueError("a pool on cpu needs --profile PATH (or give the profile's path "
                             "as the pool's device: --decode-gpu decode-profile.json)")  # fmt: skip
        dev = Device(prof.accelerator, base.eff, base.weight_dtype, base.link)
    else:
        dev = Device(get_gpu(name), base.eff, base.weight_dtype, base.link)
    link = figures["link"].get(dev.accel.name, figures["link"].get(name, dev.link))
    return replace(dev, accel=_priced(dev.accel, name, figures), link=link)


def _link_of(args: argparse.Namespace, prof) -> Link:
    if args.bandwidth_gbps is not None:
        return Link.from_gbps(args.bandwidth_gbps)
    if args.link.lower() == "loopback":
        if prof is None or not prof.loopback_bytes_per_s:
            raise ValueError("--link loopback needs --profile (it measures this machine's TCP)")
        return prof.loopback()
    return get_link(args.link)


def workload_of(args: argparse.Namespace) -> Workload:
    lengths = args.prompt_tokens or args.output_tokens
    if args.workload and lengths:
        raise ValueError("give --workload or --prompt-tokens/--output-tokens, not both")
    if lengths:
        return Workload.from_lengths(
            LengthDist.parse(args.prompt_tokens or "256"),
            LengthDist.parse(args.output_tokens or "128"),
        )
    return named_workload(args.workload or "chat")


def _check_load(args: argparse.Namespace) -> SLO:
    if not args.rate > 0 or math.isinf(args.rate):
        raise ValueError(f"--rate must be a finite number of requests/s > 0, got {args.rate}")
    return SLO(args.slo_ttft, args.slo_tpot)


def deployment_of(args: argparse.Namespace) -> Deployment:
    prefill, decode = pool_gpus(args, "prefill"), pool_gpus(args, "decode")
    if args.mode != "disagg" and (prefill or decode or args.prefill_ep > 1 or args.decode_ep > 1):
        raise ValueError(
            "--prefill-gpu/--decode-gpu and --prefill-ep/--decode-ep lay out the pools of "
            "--mode disagg; a co-located deployment runs on --gpu"
        )
    if len(prefill) > 1 or len(decode) > 1:
        raise ValueError("simulate runs one deployment: give one --prefill-gpu and one "
                         "--decode-gpu (lists are for `pdserve plan`)")  # fmt: skip
    if args.decode_pp != 1:
        raise ValueError(f"--decode-pp {args.decode_pp}: pipeline parallelism is for the prefill "
                         "pool (a decode step through a pipeline pays a hop per stage for every "
                         "token); give the decode pool --decode-tp instead")  # fmt: skip
    return Deployment(
        args.mode, args.tp, args.replicas, args.chunk, args.prefill_tp, args.num_prefill,
        args.decode_tp, args.num_decode, args.max_num_seqs, args.max_batched_tokens,
        args.local_prefill_threshold, gpu=None,
        prefill_gpu=prefill[0] if prefill else None, decode_gpu=decode[0] if decode else None,
        prefill_ep=args.prefill_ep, decode_ep=args.decode_ep, prefill_pp=args.prefill_pp,
        prefill_pp_shared=args.prefill_pp_shared,
    )  # fmt: skip


def simulate(args: argparse.Namespace) -> int:
    slo, cluster, dep = _check_load(args), cluster_of(args), deployment_of(args)
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    workload = workload_of(args)
    reqs = generate_requests(workload, args.num_requests, args.seed, args.arrival, args.rate,
                             args.burstiness)  # fmt: skip
    result = run_simulation(cluster, dep, reqs, slo)
    agg = result.aggregates
    if args.out:
        _write_results(Path(args.out), args, cluster, dep, workload, result)
    if args.json:
        print(json.dumps(agg, indent=1))
        return 0
    devices = " + ".join(f"{n} x {name}" for name, n in dep.gpus_by_device(cluster).items())
    print(f"{dep.label} ({devices}), {cluster.model.name}, "
          f"KV over {cluster.link.name}; {args.num_requests} requests of {workload.name} at "
          f"{args.rate:g}/s")  # fmt: skip
    if dep.mode in cluster.serving:
        o = cluster.serving[dep.mode]
        print(f"  with the profile's serving overhead: {o.request_s * 1e3:.1f} ms per request, "
              f"{o.step_s * 1e3:.2f} ms per step + "
              f"{o.seq_s * 1e3:.2f} ms per sequence")  # fmt: skip
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = agg[key]
        if s["count"]:
            print(f"  {key[:-2]:<5} p50 {s['p50']:.4f} s  p90 {s['p90']:.4f} s  "
                  f"p99 {s['p99']:.4f} s")  # fmt: skip
    busy = ", ".join(f"{k} {v:.0%}" for k, v in result.utilization.items())
    print(f"  SLO attainment {agg['slo_attainment']:.1%}; {agg['request_throughput']:.3g} req/s, "
          f"{agg['output_token_throughput']:.4g} output tok/s; busy: {busy}")  # fmt: skip
    return 0


def _write_results(out: Path, args, cluster, dep, workload, result) -> None:
    """results.json in bench's document shape, one run, so `bench compare` tools read it."""
    import msgspec

    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    doc = {
        "title": f"simulated: {dep.label}, {cluster.model.name} on {cluster.accel.name}",
        "config": {**config, "simulated": True},
        "goodput": None,
        "runs": [{
            "label": dep.label,
            "load": {"arrival": args.arrival, "rate": args.rate, "burstiness": args.burstiness,
                     "num_requests": args.num_requests, "seed": args.seed},
            "duration_s": result.aggregates["duration_s"],
            "aggregates": result.aggregates,
            "per_class": summarize_by_class(result.records, SLO(args.slo_ttft, args.slo_tpot),
                                            result.aggregates["duration_s"]),
            "records": result.records,
        }],
    }  # fmt: skip
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=1))


def plan(args: argparse.Namespace) -> int:
    from pdserve.sim.planner import PlanRequest
    from pdserve.sim.planner import plan as search
    from pdserve.sim.report import plan_json, plan_text

    slo, cluster = _check_load(args), cluster_of(args)
    prefill, decode = pool_gpus(args, "prefill"), pool_gpus(args, "decode")
    base = _base_gpu(args)
    req = PlanRequest(cluster, workload_of(args), args.rate, slo, args.num_gpus, args.requests,
                      args.seed, objective=args.optimize,
                      prefill_gpus=tuple(prefill or decode and [base] or [None]),
                      decode_gpus=tuple(decode or prefill and [base] or [None]))  # fmt: skip
    result = search(req)
    if args.json:
        print(json.dumps(plan_json(req, result, args.top), indent=1))
    else:
        print(plan_text(req, result, args.top))
    return 0 if result.feasible else 1
