"""Prefill parallelism side by side: prefill pipeline-parallel 2 vs tensor-parallel 2 (the
smallest size that splits the model, when 2 does not: 3 for the bundled SmolLM2) vs one prefill
worker of 2 threads, each disaggregated to one decode worker (`pdserve serve`, the
bundled model unless --model), on the same machine in one run.

For each prompt length (2,048 and 8,192 tokens by default; a length past the model's context is
cut to fit, and the table says so): TTFT of one request at a time (median of --rounds, fresh
random prompts, so no prefix hits) and prefill throughput (--concurrent requests at once: their
prompt tokens over the time until the last first token). Then the KV bytes each pipeline stage
pushed for one prompt, measured in-process on the real connectors (a prefill engine of 2
stages, a decode engine, tcp) against each stage's share of the layers: they must be equal.

Beside each measured figure, the simulator's (`pdserve simulate` of the variant on this
machine, calibrated on the served one-process prefill worker's steps: benchmarks/_prefill_sim.py)
and its error. --no-sim leaves that column out; --results FILE prints an earlier run's
--json again with the simulator's prediction made anew (after a change to the simulator).

What to expect: the point of prefill PP is several hosts, each stage with its own cores and its
own link for its layers' KV; on one 2-core machine the 2 stages share the cores with the decode
worker and each step pays a hop, so PP 2 is expected to lose to TP 2 and to one worker of 2
threads there. Do not spend a shared machine on long runs of this.

    .venv/bin/python benchmarks/prefill_parallel.py [--tokens 2048,8192] [--rounds 3]
        [--concurrent 2] [--model PATH] [--only pp,tp,threads] [--no-kv-check]
        [--no-sim] [--out DIR] [--json FILE] [--results FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _prefill_sim import (  # noqa: E402
    calibrate_round,
    ensure_profile,
    predict,
    processes,
    refit,
    shares_cores,
    sim_flags,
)
from _servers import server, stream_timings  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from factories import hand_off  # noqa: E402


def variants(model_config) -> dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """name -> (what the table calls it, serve flags, its own `pdserve simulate` flags). TP 2
    where the model's heads split by 2, else the smallest size above 1 that splits them (the
    bundled SmolLM2, 9 query heads and 3 KV heads: 3), said in its label."""
    from pdserve.engine.tp.shard import TPShard

    def splits(n: int) -> bool:
        try:
            TPShard(0, n).check(model_config)
        except ValueError:
            return False
        return True

    tp = next(n for n in range(2, model_config.num_heads + 1) if splits(n))
    why = "" if tp == 2 else f" (TP 2 does not split the model's {model_config.num_heads} heads)"
    return {
        "pp": ("prefill PP 2", ("--prefill-pp", "2"), ("--prefill-pp", "2")),
        "tp": (f"prefill TP {tp}{why}", ("--prefill-tp", str(tp)), ("--prefill-tp", str(tp))),
        "threads": ("1 prefill worker, 2 threads", ("--prefill-args", "--threads 2"), ()),
    }


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]  # random: no prefix-cache hits


def measure(url: str, lengths: list[int], rounds: int, concurrent: int, seed: int) -> dict:
    """{length: (median TTFT s, prefill tokens/s)} on the server at `url`."""
    rng, out = random.Random(seed), {}
    stream_timings(url, prompt_ids(rng, 64), 2)  # first request's one-off costs
    for n in lengths:
        ttft = statistics.median(
            stream_timings(url, prompt_ids(rng, n), 2)[0] for _ in range(rounds)
        )
        prompts = [prompt_ids(rng, n) for _ in range(concurrent)]
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrent) as pool:
            list(pool.map(lambda p: stream_timings(url, p, 1), prompts))
        out[n] = (ttft, concurrent * n / (time.perf_counter() - start))
    return out


def stage_bytes(model: str | None, tokens: int) -> tuple[list[int], list[int]]:
    """(bytes each stage of a 2-stage prefill engine pushed for one `tokens` prompt, each
    stage's share of the layers' bytes), on the real tcp connector, in this process."""
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kv_transfer import make_receiver
    from pdserve.protocol import messages as m
    from pdserve.serving.build import kv_layout, prefill_sender
    from pdserve.serving.worker_config import WorkerConfig

    d_engine = LLMEngine(EngineConfig(model=model, role="decode"))
    p_engine = LLMEngine(EngineConfig(model=model, role="prefill", pipeline_parallel_size=2))
    d_layout, p_layout = kv_layout(d_engine), kv_layout(p_engine)
    receiver = make_receiver("tcp", d_layout, d_engine.runner.k_caches, d_engine.runner.v_caches)
    receiver.start()
    config = WorkerConfig(p_engine.config, ("tcp://127.0.0.1:1",), "p0")
    sender = prefill_sender(config, p_engine, p_layout, p_engine.runner.rank_caches)
    try:
        ids = prompt_ids(random.Random(1), tokens)
        params = m.Params(max_tokens=1, ignore_eos=True)
        _, _, placement = hand_off(p_engine, d_engine, sender, receiver, ids, params, "kv")
        blocks = len(placement.block_ids) - placement.num_cached_tokens // p_layout.block_size
        share = [len(r) * p_layout.tensors * blocks * p_layout.block_bytes
                 for r in p_engine.runner.pp.layers]  # fmt: skip
        return [s.bytes for s in sender.stage_stats()], share
    finally:
        receiver.close()
        sender.close()
        d_engine.close()
        p_engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="2048,8192", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="sequential requests per length")
    ap.add_argument("--concurrent", type=int, default=2, help="requests at once (throughput)")
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--only", default="pp,tp,threads", help="variants: pp,tp,threads")
    ap.add_argument("--no-kv-check", action="store_true", help="skip the bytes per stage")
    ap.add_argument("--no-sim", action="store_true", help="no simulator column")
    ap.add_argument("--out", default="bench-results/prefill-parallel",
                    help="profiles and step logs of the simulator's calibration")  # fmt: skip
    ap.add_argument("--json", help="write the figures (and the simulate flags) here")
    ap.add_argument("--results", help="print the --json of an earlier run, measuring nothing")
    args = ap.parse_args()
    doc = json.loads(Path(args.results).read_text()) if args.results else run(args)
    if args.json and not args.results:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    report(doc)


def run(args) -> dict:
    """Measure each variant (and calibrate the simulator on the threads variant's server);
    the figures as `report` prints them."""
    from pdserve.model.loader import load_model_config

    model_config = load_model_config(args.model)[1]
    limit = model_config.max_position_embeddings - 2  # + the output
    table, names = variants(model_config), args.only.split(",")
    asked = [int(t) for t in args.tokens.split(",")]
    lengths = [min(t, limit) for t in asked]
    sim = not args.no_sim
    if sim and "threads" not in names:
        raise SystemExit("the simulator is calibrated on the threads variant's prefill worker: "
                         "add threads to --only, or give --no-sim")  # fmt: skip
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = ["--decode", "1", "--prefill", "1", "--local-prefill-threshold", "0"]
    if args.model:
        common += ["--model", args.model]
    doc = {"lengths": lengths, "asked": asked, "rounds": args.rounds,
           "concurrent": args.concurrent, "measured": {}, "sim_flags": {}}  # fmt: skip
    steps, window = out / "steps-threads", None
    for name in names:
        label, flags, _ = table[name]
        calibrating = sim and name == "threads"
        if calibrating:
            shutil.rmtree(steps, ignore_errors=True)
            flags = (*flags, "--step-log", str(steps))
        with server("disagg", *common, *flags) as url:
            if calibrating:
                window = calibrate_round(url, max(lengths))
            doc["measured"][label] = measure(url, lengths, args.rounds, args.concurrent, seed=0)
    if sim:
        profile = ensure_profile(out / "profile-1t.json", args.model)
        prefill = refit(profile, steps, window, out / "profile-prefill.json")
        doc["sim_flags"] = {table[n][0]: sim_flags(table[n][2], prefill, profile) for n in names}
        doc["shared_cores"] = [table[n][0] for n in names if shares_cores(processes(table[n][2]))]
    if not args.no_kv_check:
        doc["stage_bytes"] = stage_bytes(args.model, lengths[0])
    return doc


def report(doc: dict) -> None:
    """The measured table, with the simulator's prediction and its error beside each figure
    when the run was calibrated for it."""
    lengths, flags = doc["lengths"], doc.get("sim_flags", {})
    measured = {
        label: {int(n): v for n, v in per.items()} for label, per in doc["measured"].items()
    }
    predicted = {label: {n: predict(flags[label], n, doc["concurrent"]) for n in lengths}
                 for label in measured if label in flags}  # fmt: skip
    sim = " (sim: `pdserve simulate` calibrated on this machine)" if predicted else ""
    print(f"\nprefill, disaggregated to 1 decode worker; TTFT median of {doc['rounds']}, "
          f"throughput at {doc['concurrent']} at once{sim}")  # fmt: skip
    cols = ("TTFT", "sim", "err", "tok/s", "sim", "err") if predicted else ("TTFT", "tok/s")
    width = max(map(len, measured)) + 2
    print(f"{'variant':<{width}}" + "".join(f"{f'{n} {c}' if c == 'TTFT' else c:>11}"
                                            for n in lengths for c in cols))  # fmt: skip
    for label, per in measured.items():
        cells = []
        for n in lengths:
            (ttft, tok_s), guess = per[n], predicted.get(label, {}).get(n)
            if guess is not None:
                cells += [f"{ttft:.2f} s", f"{guess[0]:.2f} s", _err(guess[0], ttft),
                          f"{tok_s:.0f}", f"{guess[1]:.0f}", _err(guess[1], tok_s)]  # fmt: skip
            else:
                none = ["-", "-"] if predicted else []
                cells += [f"{ttft:.2f} s", *none, f"{tok_s:.0f}", *none]
        print(f"{label:<{width}}" + "".join(f"{c:>11}" for c in cells))
    for label, f in flags.items():
        print(f"  sim of {label}: pdserve simulate {' '.join(f)}")
        if "--prefill-pp-shared" in f:  # what the stages would give on cores of their own
            own = [x for x in f if x != "--prefill-pp-shared"]
            guess = [(n, *predict(own, n, doc["concurrent"])) for n in lengths]
            cells = ", ".join(f"{n} tok {t:.2f} s, {r:.0f} tok/s" for n, t, r in guess)
            print(f"    its stages on cores of their own (not measurable here): {cells}")
        if "--prefill-tp" in f and label in doc.get("shared_cores", []):
            print("    its ranks share the prefill worker's cores here; the simulator gives "
                  "each a device of its own (not modelled)")  # fmt: skip
    cut = [f"{a} -> {n}" for a, n in zip(doc["asked"], lengths, strict=True) if a != n]
    if cut:
        print(f"(prompt lengths cut to the model's context: {', '.join(cut)})")
    if "stage_bytes" in doc:
        sent, share = doc["stage_bytes"]
        print(f"\nKV bytes per stage for one {lengths[0]}-token prompt (PP 2, tcp):")
        for s, (b, want) in enumerate(zip(sent, share, strict=True)):
            print(f"  stage {s}: {b:,} bytes (its layers' share: {want:,}"
                  f"{', equal' if b == want else ', DIFFERENT'})")  # fmt: skip


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}"


if __name__ == "__main__":
    main()
