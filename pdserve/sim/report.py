"""What `pdserve plan` prints: the recommendation, its reasons in numbers, the runner-ups.

About 350 lines: every sentence of the plan's report, text and JSON, in one place.
"""

from __future__ import annotations

from dataclasses import asdict

from pdserve.sim.deployment import Pool
from pdserve.sim.kvmath import format_duration
from pdserve.sim.latency import Batch
from pdserve.sim.planner import (
    Candidate,
    Plan,
    PlanRequest,
    cost_per_million_tokens,
    goodput_per_dollar,
    mean_lengths,
    rank_key,
)


def candidate_json(c: Candidate, req: PlanRequest) -> dict:
    """A candidate as plain JSON: deployment, GPUs, cost, attainment, goodput and bench
    aggregates."""
    cl = req.cluster
    return {
        "label": c.deployment.label,
        "deployment": asdict(c.deployment),
        "num_gpus": c.deployment.num_gpus,
        "gpus_by_device": c.deployment.gpus_by_device(cl),
        "cost_per_hour": c.deployment.cost_per_hour(cl),
        "power_w": c.deployment.power_w(cl),
        "cost_per_million_tokens": cost_per_million_tokens(c, req),
        "goodput_per_dollar": goodput_per_dollar(c, req),
        "slo_attainment": c.attainment,
        "goodput_rps_estimate": c.goodput,
        "goodput_per_gpu": c.goodput_per_gpu,
        "utilization": c.result.utilization,
        "aggregates": c.result.aggregates,
    }


def best_per_mode(plan: Plan) -> dict[str, Candidate]:
    out: dict[str, Candidate] = {}
    for c in plan.feasible:
        out.setdefault(c.deployment.mode, c)
    return out


def devices_text(c: Candidate, req: PlanRequest) -> str:
    """ "2 x h100-sxm + 3 x a100-80gb", and its $ per hour when the devices have prices."""
    by = c.deployment.gpus_by_device(req.cluster)
    text = " + ".join(f"{n} x {name}" for name, n in by.items())
    dollars = c.deployment.cost_per_hour(req.cluster)
    return f"{text} (${dollars:.2f}/h)" if dollars else text


def _line(c: Candidate, slo, req: PlanRequest | None = None) -> str:
    a = c.result.aggregates
    ttft, tpot = a["ttft_s"]["p90"], a["tpot_s"]["p90"]
    tpot_text = format_duration(tpot) if tpot is not None else "n/a"
    gpus = devices_text(c, req) if req else f"{c.deployment.num_gpus} GPUs"
    return (
        f"{c.deployment.label}: {gpus}, attainment {c.attainment:.1%}, "
        f"TTFT p90 {format_duration(ttft or 0)} (SLO {format_duration(slo.ttft_s)}), "
        f"TPOT p90 {tpot_text} (SLO {format_duration(slo.tpot_s)}), "
        f"~{c.goodput_per_gpu:.3g} req/s per GPU"
    )


def reasons(req: PlanRequest, plan: Plan) -> list[str]:
    """The numbers behind the choice: phase times, KV transfer, each mode's best, idle pools."""
    cl, slo = req.cluster, req.slo
    prompt, output = mean_lengths(req.workload)
    best = plan.feasible[0] if plan.feasible else plan.closest
    dep = best.deployment
    pools = dep.pools()  # co-located: one pool does both phases
    pre, dec = pools[0], pools[-1]
    lat = cl.latency(pre.tp, gpu=pre.gpu, ep=pre.ep, pp=pre.pp)
    chunk = dep.chunk if pre.pp > 1 else None  # a pipeline's micro-batches
    took = lat.prefill(prompt, chunk=chunk)
    out = [
        f"prefill of a {prompt:,}-token prompt takes {format_duration(took)} at "
        f"{_shape(pre)} on {lat.accel.name} ({took / slo.ttft_s:.0%} of the "
        f"{format_duration(slo.ttft_s)} TTFT budget)"
    ]
    if pre.pp > 1:
        out.append(_pipeline_reason(req, pre, prompt, chunk))
    dlat = cl.latency(dec.tp, gpu=dec.gpu, ep=dec.ep)
    step = dlat.iteration_decode(32, 32 * (prompt + output / 2))
    out.append(
        f"a decode step of 32 sequences at ~{prompt + output // 2:,} tokens takes "
        f"{format_duration(step)} at {_shape(dec)} on "
        f"{dlat.accel.name} (TPOT budget {format_duration(slo.tpot_s)})"
    )
    out.append(_transfer_reason(req, prompt, pre, dec.gpu))
    for mode, c in best_per_mode(plan).items():
        out.append(f"best {_MODE_NAMES[mode]}: {_line(c, slo, req)}")
    if plan.feasible:
        out.append(_verdict(best_per_mode(plan), req))
        if len(req.kinds) > 1:
            out.append(mixed_vs_homogeneous(req, plan))
    if dep.mode == "disagg" and dep.prefill_tp != dep.decode_tp:
        out.append(_per_phase_reason(plan, best, slo))
    missing = {"colocated", "disagg"} - set(best_per_mode(plan))
    for mode in sorted(missing):
        out.append(f"no {_MODE_NAMES[mode]} deployment met the SLOs within the GPU budget")
    dis = best_per_mode(plan).get("disagg")
    if dis and dep.mode == "colocated":
        util = dis.result.utilization
        out.append(
            f"disaggregated needs separate pools: at {req.rate:g} req/s its prefill pool is busy "
            f"{util['prefill']:.0%} and its decode pool {util['decode']:.0%} of the time "
            f"(decode counts as busy whenever any sequence is decoding)"
        )
    return out


_MODE_NAMES = {"colocated": "co-located", "disagg": "disaggregated"}


def _shape(pool: Pool) -> str:
    """ "TP8", "TP1 EP8", "TP8 PP2": one instance's parallelism."""
    ep = f" EP{pool.ep}" if pool.ep > 1 else ""
    return f"TP{pool.tp}{ep}{f' PP{pool.pp}' if pool.pp > 1 else ''}"


def _pipeline_reason(req: PlanRequest, pool: Pool, prompt: int, chunk: int) -> str:
    """A prefill pipeline's time for the mean prompt: its micro-batches, stage times, bubble
    and activation hops, against one stage's shape alone."""
    cl = req.cluster
    lat = cl.latency(pool.tp, gpu=pool.gpu, ep=pool.ep, pp=pool.pp)
    alone = cl.latency(pool.tp, gpu=pool.gpu, ep=pool.ep).prefill(prompt)
    m, last = -(-prompt // chunk), prompt - chunk  # the last micro-batch's first token
    first = lat.stage(Batch(chunk, 0, chunk * chunk / 2, 0, 1))
    final = lat.stage(Batch(chunk, 0, chunk * (last + chunk / 2), last, 1))
    nodes = "across nodes" if lat.devices > lat.accel.max_tp else "within a node"
    return (
        f"pipeline of {pool.pp} stages of {lat.stage_layers} layers on {lat.gpus} devices each "
        f"({lat.devices} in all): the {prompt:,}-token prompt in {m} micro-batches of "
        f"{chunk:,} tokens takes {format_duration(lat.prefill(prompt, chunk=chunk))} = "
        f"(m + {pool.pp - 1}) stage times of {format_duration(first)}-{format_duration(final)} "
        f"+ {pool.pp - 1} x {format_duration(lat.hop_s(chunk))} to pass "
        f"{lat.activation_bytes(chunk) / 1e6:.3g} MB of activations over "
        f"{lat.stage_link.name} ({nodes}); one {_shape(pool._replace(pp=1))} instance alone "
        f"takes {format_duration(alone)}"
    )


def mixed_vs_homogeneous(req: PlanRequest, plan: Plan) -> str:
    """The best deployment with prefill and decode on different hardware against the best on
    one type, under the objective: $ per hour, $ per million tokens, requests per dollar."""
    mixed = [c for c in plan.feasible if c.deployment.heterogeneous]
    same = [c for c in plan.feasible if not c.deployment.heterogeneous]
    if not mixed or not same:
        which = "mixed-hardware" if not mixed else "single-hardware"
        return f"no {which} deployment met the SLOs, so there is nothing to compare it with"
    m, h = mixed[0], same[0]

    def money(c: Candidate) -> str:
        if not c.deployment.cost_per_hour(req.cluster):
            return f"{devices_text(c, req)}, {c.deployment.power_w(req.cluster):,.0f} W"
        return (f"{devices_text(c, req)}, ${cost_per_million_tokens(c, req):.3f} per million "
                f"tokens, {goodput_per_dollar(c, req):,.0f} requests per $")  # fmt: skip

    winner = "mixed" if rank_key(m, req.cluster, req.objective) < rank_key(
        h, req.cluster, req.objective) else "single-hardware"  # fmt: skip
    ratio = ""
    mc, hc = goodput_per_dollar(m, req), goodput_per_dollar(h, req)
    if mc and hc:
        ratio = f"; mixed gives {mc / hc:.2f}x the goodput per dollar"
    return (
        f"mixed hardware ({m.deployment.label}: {money(m)}) vs the best on one type "
        f"({h.deployment.label}: {money(h)}): {winner} wins on {req.objective}{ratio}"
    )


def _verdict(best: dict[str, Candidate], req: PlanRequest) -> str:
    if len(best) < 2:
        return "only one mode is feasible, so it wins"
    win, lose = sorted(best.values(), key=lambda c: rank_key(c, req.cluster, req.objective))
    w, los = _MODE_NAMES[win.deployment.mode], _MODE_NAMES[lose.deployment.mode]
    if req.objective != "gpus":
        unit = "$/h" if req.objective == "cost" else "W"
        fig = win.deployment.cost_per_hour if req.objective == "cost" else win.deployment.power_w
        lfig = (lose.deployment.cost_per_hour if req.objective == "cost"
                else lose.deployment.power_w)  # fmt: skip
        return (f"{w} costs {fig(req.cluster):,.2f} {unit}, {los} "
                f"{lfig(req.cluster):,.2f} {unit}")  # fmt: skip
    if win.deployment.num_gpus < lose.deployment.num_gpus:
        return f"{w} needs {win.deployment.num_gpus} GPUs, {los} {lose.deployment.num_gpus}"
    gain = win.goodput_per_gpu / lose.goodput_per_gpu - 1 if lose.goodput_per_gpu else 0.0
    return (
        f"both need {win.deployment.num_gpus} GPUs; {w} sustains {gain:.0%} more goodput per "
        f"GPU (estimated), so it wins the tie"
    )


def _per_phase_reason(plan: Plan, best: Candidate, slo) -> str:
    """The chosen per-phase TP against the best disaggregated deployment of one TP for both."""
    equal = [
        c
        for c in plan.feasible
        if c.deployment.mode == "disagg" and c.deployment.prefill_tp == c.deployment.decode_tp
    ]
    dep = best.deployment
    head = f"per-phase TP (prefill TP{dep.prefill_tp}, decode TP{dep.decode_tp})"
    if not equal:
        return f"{head}: no disaggregated deployment with one TP for both phases met the SLOs"
    other = equal[0]
    if other.deployment.num_gpus > dep.num_gpus:
        verdict = f"{other.deployment.num_gpus - dep.num_gpus} fewer GPUs"
    else:
        gain = best.goodput_per_gpu / other.goodput_per_gpu - 1 if other.goodput_per_gpu else 0
        verdict = (f"{gain:.0%} more goodput per GPU on as many GPUs" if gain >= 0.005
                   else "a tie on GPUs and goodput per GPU (either deploys)")  # fmt: skip
    return f"{head} against the best with one TP for both phases, {_line(other, slo)}: {verdict}"


def _transfer_reason(req: PlanRequest, prompt: int, pre: Pool, dgpu=None) -> str:
    """The KV of a prompt over the link from one prefill instance (a pipeline's stages each
    push their own layers over their own ports)."""
    cl, slo, devices = req.cluster, req.slo, pre.instance_devices
    nbytes = cl.wire_bytes(prompt)
    link = min((cl.device(pre.gpu).link, cl.device(dgpu).link),
               key=lambda k: k.instance_bytes_per_s(devices))  # the slower end's  # fmt: skip
    bw = link.instance_bytes_per_s(devices)
    t = nbytes / bw
    last = t / cl.model.num_layers
    demand = req.rate * nbytes
    return (
        f"KV transfer of a {prompt:,}-token prompt ({nbytes / 1e9:.3g} GB) over {link.name} "
        f"from a {_shape(pre)} instance ({bw / 1e9:.3g} GB/s) takes {format_duration(t)} = "
        f"{t / slo.ttft_s:.0%} of the TTFT budget; streamed layer by layer, "
        f"{format_duration(last)} of it (the last layer) adds to TTFT while a layer transfers "
        f"faster than it computes; at {req.rate:g} req/s the KV stream is "
        f"{demand / 1e9:.3g} GB/s, {demand / bw:.0%} of one such instance's ports"
    )


def plan_text(req: PlanRequest, plan: Plan, top: int = 3) -> str:
    """The human-readable plan."""
    cl = req.cluster
    kinds = ", ".join(cl.device(g).name for g in req.kinds)
    head = (f"{cl.model.name} on {kinds}, KV over {cl.link.name}, {req.rate:g} req/s, "
            f"optimizing {req.objective}")  # fmt: skip
    if not plan.feasible:
        lines = [f"{head}: no configuration meets these SLOs"]
        if plan.closest:
            lines.append(f"closest: {_line(plan.closest, req.slo, req)}")
            lines.append(f"  to fix: {_relax_hint(plan.closest, req)}")
            lines += [f"  - {r}" for r in reasons(req, plan)]
        return "\n".join(lines)
    best = plan.feasible[0]
    lines = [
        head,
        f"recommendation: {best.deployment.label} = {devices_text(best, req)}",
        f"  {_line(best, req.slo, req)}",
        "why:",
        *[f"  - {r}" for r in reasons(req, plan)],
    ]
    cmd, note = serve_command(best.deployment)
    if cmd is None:
        lines.append(f"deploy: {note}")
    else:
        lines.append(f"deploy: {cmd}" + (f"  ({note})" if note else ""))
    if len(plan.feasible) > 1:
        lines.append("runner-ups:")
        lines += [
            f"  {i}. {_line(c, req.slo, req)}" for i, c in enumerate(plan.feasible[1 : top + 1], 2)
        ]
    return "\n".join(lines)


def serve_command(dep) -> tuple[str | None, str]:
    """(the `pdserve serve` command that deploys `dep`, None when pdserve cannot yet; what to
    know about it)."""
    tp_note = "tensor parallelism runs on CPU ranks (gloo) for now, not on GPUs"
    if dep.tp > 1 and dep.mode == "colocated":
        cmd = (f"pdserve serve --mode colocated --colocated-workers {dep.replicas} "
               f"--tensor-parallel-size {dep.tp}")  # fmt: skip
        note = tp_note
    elif dep.mode == "colocated":
        cmd, note = f"pdserve serve --mode colocated --colocated-workers {dep.replicas}", ""
    else:
        cmd = (f"pdserve serve --mode disagg --prefill {dep.num_prefill} --decode "
               f"{dep.num_decode} --local-prefill-threshold "
               f"{dep.local_prefill_threshold}")  # fmt: skip
        if dep.local_prefill_threshold and not dep.short_prefills_to_idle_pool:
            cmd += " --keep-short-prefills-local"
        if dep.decode_chunk:
            cmd += f" --decode-chunk-size {dep.decode_chunk}"
        note = "one worker per GPU with the local launcher (prefill workers first)"
        if max(dep.prefill_tp, dep.decode_tp) > 1:
            cmd += f" --prefill-tp {dep.prefill_tp} --decode-tp {dep.decode_tp}"
            note = (f"{tp_note}; the KV heads are re-sharded from each prefill group's "
                    f"{dep.prefill_tp} ranks into each decode group's {dep.decode_tp}")  # fmt: skip
        for flag, ep in (("--prefill-ep", dep.prefill_ep), ("--decode-ep", dep.decode_ep)):
            if ep > 1:
                cmd += f" {flag} {ep}"
        if dep.prefill_pp > 1:
            cmd += f" --prefill-pp {dep.prefill_pp}"
            note += ("; each prefill worker is a pipeline of --prefill-pp stages, each pushing its "
                     "own layers' KV (the engine's stages run on one host, and not yet with "
                     "--prefill-tp > 1)")  # fmt: skip
        if dep.heterogeneous:
            note += (f"; run the prefill pool on {dep.prefill_gpu or 'the --gpu'} and the decode "
                     f"pool on {dep.decode_gpu or 'the --gpu'} (per pool: --prefill-args / "
                     "--decode-args \"--device ...\", or --prefill-resources / "
                     "--decode-resources with the Ray launcher)")  # fmt: skip
    if dep.chunk:
        flag = f"--chunk-size {dep.chunk}"
        cmd += f" {flag}" if dep.mode == "colocated" else f' --prefill-args "{flag}"'
    cmd += f" --max-num-seqs {dep.max_num_seqs}"
    return cmd, note


def _relax_hint(c: Candidate, req: PlanRequest) -> str:
    """Which targets the closest configuration misses, and what would let it pass."""
    a, slo, fixes = c.result.aggregates, req.slo, []
    ttft, tpot = a["ttft_s"]["p90"], a["tpot_s"]["p90"]
    if ttft is not None and ttft > slo.ttft_s:
        fixes.append(f"--slo-ttft >= {ttft:.3g}")
    if tpot is not None and tpot > slo.tpot_s:
        fixes.append(f"--slo-tpot >= {tpot:.3g}")
    budget = " or a larger --num-gpus" if req.max_gpus else ""
    return (
        f"relax {' and '.join(fixes) or 'the SLOs'} (its p90s), lower --rate, or use faster "
        f"GPUs/links{budget}"
    )


def plan_json(req: PlanRequest, plan: Plan, top: int = 3) -> dict:
    """The plan for `--json`."""
    return {
        "model": req.cluster.model.name,
        "gpu": req.cluster.accel.name,
        "link": req.cluster.link.name,
        "rate": req.rate,
        "slo": {"ttft_s": req.slo.ttft_s, "tpot_s": req.slo.tpot_s},
        "feasible": bool(plan.feasible),
        "objective": req.objective,
        "devices": [req.cluster.device(g).name for g in req.kinds],
        "recommendation": candidate_json(plan.feasible[0], req) if plan.feasible else None,
        "serve_command": serve_command(plan.feasible[0].deployment)[0] if plan.feasible else None,
        "runner_ups": [candidate_json(c, req) for c in plan.feasible[1 : top + 1]],
        "closest": candidate_json(plan.closest, req) if plan.closest else None,
        "message": None if plan.feasible else "no configuration meets these SLOs",
        "reasons": reasons(req, plan) if plan.feasible or plan.closest else [],
    }
