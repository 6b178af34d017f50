"""What `pdserve plan` prints: the recommendation, its reasons in numbers, the runner-ups."""

from __future__ import annotations

from dataclasses import asdict

from pdserve.sim.kvmath import format_duration
from pdserve.sim.planner import Candidate, Plan, PlanRequest


def candidate_json(c: Candidate) -> dict:
    """A candidate as plain JSON: deployment, GPUs, attainment, goodput and bench aggregates."""
    return {
        "label": c.deployment.label,
        "deployment": asdict(c.deployment),
        "num_gpus": c.deployment.num_gpus,
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


def _mean_lengths(req: PlanRequest) -> tuple[int, int]:
    probs = req.workload.probabilities
    prompt = sum(p * c.prompt.expected for p, c in zip(probs, req.workload.classes, strict=True))
    output = sum(p * c.output.expected for p, c in zip(probs, req.workload.classes, strict=True))
    return round(prompt), round(output)


def _line(c: Candidate, slo) -> str:
    a = c.result.aggregates
    ttft, tpot = a["ttft_s"]["p90"], a["tpot_s"]["p90"]
    tpot_text = format_duration(tpot) if tpot is not None else "n/a"
    return (
        f"{c.deployment.label}: {c.deployment.num_gpus} GPUs, attainment {c.attainment:.1%}, "
        f"TTFT p90 {format_duration(ttft or 0)} (SLO {format_duration(slo.ttft_s)}), "
        f"TPOT p90 {tpot_text} (SLO {format_duration(slo.tpot_s)}), "
        f"~{c.goodput_per_gpu:.3g} req/s per GPU"
    )


def reasons(req: PlanRequest, plan: Plan) -> list[str]:
    """The numbers behind the choice: phase times, KV transfer, each mode's best, idle pools."""
    cl, slo = req.cluster, req.slo
    prompt, output = _mean_lengths(req)
    best = plan.feasible[0] if plan.feasible else plan.closest
    dep = best.deployment
    ptp = dep.tp if dep.mode == "colocated" else dep.prefill_tp
    lat = cl.latency(ptp)
    out = [
        f"prefill of a {prompt:,}-token prompt takes {format_duration(lat.prefill(prompt))} at "
        f"TP{ptp} ({lat.prefill(prompt) / slo.ttft_s:.0%} of the {format_duration(slo.ttft_s)} "
        f"TTFT budget)"
    ]
    dtp = dep.tp if dep.mode == "colocated" else dep.decode_tp
    step = cl.latency(dtp).iteration_decode(32, 32 * (prompt + output / 2))
    out.append(
        f"a decode step of 32 sequences at ~{prompt + output // 2:,} tokens takes "
        f"{format_duration(step)} at TP{dtp} (TPOT budget {format_duration(slo.tpot_s)})"
    )
    out.append(_transfer_reason(req, prompt, ptp))
    for mode, c in best_per_mode(plan).items():
        out.append(f"best {_MODE_NAMES[mode]}: {_line(c, slo)}")
    if plan.feasible:
        out.append(_verdict(best_per_mode(plan)))
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


def _verdict(best: dict[str, Candidate]) -> str:
    if len(best) < 2:
        return "only one mode is feasible, so it wins"
    win, lose = sorted(best.values(), key=lambda c: (c.deployment.num_gpus, -c.goodput_per_gpu))
    w, los = _MODE_NAMES[win.deployment.mode], _MODE_NAMES[lose.deployment.mode]
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


def _transfer_reason(req: PlanRequest, prompt: int, ptp: int) -> str:
    cl, slo = req.cluster, req.slo
    nbytes = cl.wire_bytes(prompt)
    bw = cl.link.instance_bytes_per_s(ptp)
    t = nbytes / bw
    last = t / cl.model.num_layers
    demand = req.rate * nbytes
    return (
        f"KV transfer of a {prompt:,}-token prompt ({nbytes / 1e9:.3g} GB) over {cl.link.name} "
        f"from a TP{ptp} instance ({bw / 1e9:.3g} GB/s) takes {format_duration(t)} = "
        f"{t / slo.ttft_s:.0%} of the TTFT budget; streamed layer by layer, "
        f"{format_duration(last)} of it (the last layer) adds to TTFT while a layer transfers "
        f"faster than it computes; at {req.rate:g} req/s the KV stream is "
        f"{demand / 1e9:.3g} GB/s, {demand / bw:.0%} of one such instance's ports"
    )


def plan_text(req: PlanRequest, plan: Plan, top: int = 3) -> str:
    """The human-readable plan."""
    cl = req.cluster
    head = f"{cl.model.name} on {cl.accel.name}, KV over {cl.link.name}, {req.rate:g} req/s"
    if not plan.feasible:
        lines = [f"{head}: no configuration meets these SLOs"]
        if plan.closest:
            lines.append(f"closest: {_line(plan.closest, req.slo)}")
            lines.append(f"  to fix: {_relax_hint(plan.closest, req)}")
            lines += [f"  - {r}" for r in reasons(req, plan)]
        return "\n".join(lines)
    best = plan.feasible[0]
    lines = [
        head,
        f"recommendation: {best.deployment.label} = {best.deployment.num_gpus} x {cl.accel.name}",
        f"  {_line(best, req.slo)}",
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
            f"  {i}. {_line(c, req.slo)}" for i, c in enumerate(plan.feasible[1 : top + 1], 2)
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
        "recommendation": candidate_json(plan.feasible[0]) if plan.feasible else None,
        "serve_command": serve_command(plan.feasible[0].deployment)[0] if plan.feasible else None,
        "runner_ups": [candidate_json(c) for c in plan.feasible[1 : top + 1]],
        "closest": candidate_json(plan.closest) if plan.closest else None,
        "message": None if plan.feasible else "no configuration meets these SLOs",
        "reasons": reasons(req, plan) if plan.feasible or plan.closest else [],
    }
