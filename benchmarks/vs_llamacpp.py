"""pdserve against llama.cpp on the same GGUF and thread count, side by side in one run.

Engine: llama-bench (pp512, pp2048, tg128) against pdserve's engine in this process (prefill
of one fresh prompt; decode of 128 tokens after a 1-token prompt, batch 1), repeats interleaved,
medians. Served: `pdserve bench` (256-token prompts, 128 out, closed loop at concurrency 1 and
16) against llama-server -np 16, pdserve co-located and pdserve disaggregated (1 prefill core +
1 decode core), each started here and stopped after; peak RSS of every pdserve worker.

    .venv/bin/python benchmarks/vs_llamacpp.py [--threads 2] [--skip-served] [--out vs.json]

llama.cpp is found in $LLAMA_CPP_BIN or ~/.cache/pdserve/llama.cpp, else built there with
../shared/tools/build-llama-cpp.sh (~5 minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _llamacpp import find_bin, no_repack  # noqa: E402
from _servers import closed_loop  # noqa: E402

SERVED = {"concurrency": (1, 16), "requests": {1: 16, 16: 64}, "prompt": 256, "output": 128}


def llama_bench(binary: Path, model: Path, threads: int, repeats: int) -> dict[str, float]:
    cmd = [
        str(binary / "llama-bench"),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-p",
        "512,2048",
        "-n",
        "128",
        "-r",
        str(repeats),
        "-o",
        "json",
        *no_repack("llama-bench"),
    ]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    out = {}
    for r in rows:
        name = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        out[name] = r["avg_ts"]
    return out


def ours_engine(weights: str, eager: bool, threads: int, repeats: int) -> dict[str, float]:
    from pdserve import LLM, SamplingParams

    llm = LLM(weights=weights, enforce_eager=eager, num_threads=threads)
    vocab, count = llm.model_config.vocab_size - 16, [0]

    def prompt(n):  # distinct prompts: the prefix cache never turns a prefill into a hit
        count[0] += 1
        return [(count[0] * 7919 + 31 * i * i + 17 * i) % vocab + 8 for i in range(n)]

    def timed(ids, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        start = time.perf_counter()
        llm.generate([ids], params)
        return time.perf_counter() - start

    timed(prompt(64), 4)  # warm
    out = {}
    for n in (512, 2048):
        out[f"pp{n}"] = n / statistics.median(timed(prompt(n), 1) for _ in range(repeats))
    # tg128: 128 decode steps after a 1-token prompt (its prefill is one more step, ~same cost)
    out["tg128"] = 129 / statistics.median(timed(prompt(1), 129) for _ in range(repeats))
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids + [g for k in kids for g in _children(k)]


def worker_peak_rss_mib(root_pid: int) -> list[float]:
    """VmHWM of every descendant process that loaded torch (the workers)."""
    out = []
    for pid in _children(root_pid):
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "worker" in cmd:
                hwm = next(ln for ln in status.splitlines() if ln.startswith("VmHWM"))
                out.append(int(hwm.split()[1]) / 1024)
    return out


def bench(url: str, concurrency: int, out_dir: Path) -> dict:
    n, prompt, output = SERVED["requests"][concurrency], SERVED["prompt"], SERVED["output"]
    agg = closed_loop(url, concurrency, n, prompt, output, out_dir)
    return {
        "tok_s": agg["output_token_throughput"],
        "itl_p50_ms": agg["itl_s"]["p50"] * 1e3,
        "ttft_p50_ms": agg["ttft_s"]["p50"] * 1e3,
        "errors": agg["num_requests"] - agg["status"].get("ok", 0),
    }


def served(binary: Path, model: Path, threads: int, tmp: Path) -> dict[str, dict]:
    from pdserve.bench.compare import CommandSpec, ServerProcess, ServerSpec, default_serve_cmd

    llama = (str(binary / "llama-server"), "-m", str(model), "-t", str(threads), "-c", "32768",
             *no_repack("llama-server"))  # fmt: skip
    before = ("--weights", "bf16", "--enforce-eager")
    systems = {
        "llama-server -np 16": CommandSpec((*llama, "-np", "16")),
        "pdserve colocated": ServerSpec(default_serve_cmd(), "colocated"),
        "pdserve disagg (1 P + 1 D core)": ServerSpec(default_serve_cmd(), "disagg"),
        "pdserve colocated, before (--weights bf16 --enforce-eager)": ServerSpec(
            default_serve_cmd(), "colocated", extra=before
        ),
    }
    results = {}
    for i, (name, spec) in enumerate(systems.items()):
        server = ServerProcess(spec, tmp / f"server-{i}.log")
        with server as url:
            row = {c: bench(url, c, tmp / f"server-{i}-c{c}") for c in SERVED["concurrency"]}
            for c in SERVED["concurrency"]:
                print(f"  {name}, concurrency {c}: {row[c]}", flush=True)
            if name.startswith("pdserve"):
                row["worker_peak_rss_mib"] = worker_peak_rss_mib(server.proc.pid)
        results[name] = row
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-served", action="store_true", help="engine figures only")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args()

    from pdserve.model.loader import bundled_model_path

    model, binary = bundled_model_path(), find_bin()
    print(f"llama.cpp: {binary}\nmodel: {model}\nthreads: {args.threads}\n", flush=True)
    llama = llama_bench(binary, model, args.threads, args.repeats)
    ours = {
        "auto, fused": ours_engine("auto", False, args.threads, args.repeats),
        "bf16, eager (before)": ours_engine("bf16", True, args.threads, args.repeats),
    }
    print("| figure | llama.cpp | " + " | ".join(f"pdserve {k}" for k in ours) + " | ratio |")
    print("|---|---|" + "---|" * len(ours) + "---|")
    for key, label in (
        ("pp512", "prefill 512"),
        ("pp2048", "prefill 2,048"),
        ("tg128", "decode, batch 1 (tg128)"),
    ):
        cells = " | ".join(f"{o[key]:.1f} tok/s" for o in ours.values())
        ratio = ours["auto, fused"][key] / llama[key]
        print(f"| {label} | {llama[key]:.1f} tok/s | {cells} | {ratio:.2f}x |")
    doc = {"llama_bench": llama, "ours": ours, "threads": args.threads}
    if not args.skip_served:
        with tempfile.TemporaryDirectory() as tmp:
            doc["served"] = served(binary, model, args.threads, Path(tmp))
        print(served_table(doc["served"]))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2, default=str))
    return 0


def served_table(res: dict[str, dict]) -> str:
    base = res["llama-server -np 16"]
    lines = [
        "",
        f"Served, {SERVED['prompt']}-token prompts / {SERVED['output']} out, closed loop:",
        "| server | c=1 tok/s | c=1 ITL p50 | c=1 TTFT p50 | c=16 tok/s | c=16 vs llama | "
        "peak RSS per worker |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in res.items():
        one, many = row[1], row[16]
        rss = ", ".join(f"{r:.0f} MiB" for r in row.get("worker_peak_rss_mib", [])) or "-"
        lines.append(
            f"| {name} | {one['tok_s']:.1f} | {one['itl_p50_ms']:.1f} ms | "
            f"{one['ttft_p50_ms']:.0f} ms | {many['tok_s']:.1f} | "
            f"{many['tok_s'] / base[16]['tok_s']:.2f}x | {rss} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
