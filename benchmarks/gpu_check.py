"""The GPU path end to end, with figures: run it on a machine with a CUDA GPU.

1. Engine on the GPU (bfloat16): prefill tokens/s of one fresh prompt and decode ms per step at
   several batch sizes (every sequence decoding, 128-token contexts), beside transformers'
   `AutoModelForCausalLM` on the same weights; medians of `--repeats` interleaved runs.
2. Serving on the GPU: `pdserve serve --device cuda` co-located (one worker) and disaggregated
   (a prefill and a decode worker sharing the GPU; every prompt's KV staged through pinned host
   memory and streamed layer by layer over tcp), each driven by `pdserve bench` with the same
   mixed workload at `--rate`: TTFT and TPOT p50/p90, tokens/s, and the KV bytes moved.

    python benchmarks/gpu_check.py [--model PATH] [--out gpu-check.json]
    python benchmarks/gpu_check.py --random-weights DIR   # DIR: config.json + tokenizer files

`--random-weights` writes random weights of DIR's config into DIR (once) and runs on them: the
same shapes cost the same time, for a machine that lacks the bundled model's file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from _servers import metric, server  # sibling modules: this script runs as a file
from engine import Ours, Prompts, Theirs

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def write_random_weights(folder: Path, seed: int = 0) -> None:
    """model.safetensors with normal(0, 1/sqrt(fan_in)) weights of `folder/config.json`'s
    Llama shapes (bfloat16), unless it is there already."""
    from safetensors.torch import save_file

    out = folder / "model.safetensors"
    if out.exists():
        return
    c = json.loads((folder / "config.json").read_text())
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) / cols**0.5).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
    weights = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": ones(d)}
    if not c.get("tie_word_embeddings"):
        weights["lm_head.weight"] = w(v, d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": ones(d),
            p + "post_attention_layernorm.weight": ones(d),
            p + "self_attn.q_proj.weight": w(q, d),
            p + "self_attn.k_proj.weight": w(kv, d),
            p + "self_attn.v_proj.weight": w(kv, d),
            p + "self_attn.o_proj.weight": w(d, q),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
        }
    save_file(weights, str(out))


def engine_figures(args, model: str | None) -> list[dict]:
    """Each system in turn (the GPU's speed holds still; a CPU's would need interleaving)."""
    rows: list[dict] = []
    for name, make in (
        ("pdserve", lambda: Ours("bfloat16", None, args.kv_cache_gb, device=args.device,
                                 model=model)),
        ("transformers", lambda: Theirs("bfloat16", device=args.device, model=model)),
    ):  # fmt: skip
        try:
            system_figures(args, make(), rows)
        except Exception as exc:  # keep the rows measured; say what failed
            print(f"{name} failed: {type(exc).__name__}: {exc}", flush=True)
            rows.append({"system": name, "error": f"{type(exc).__name__}: {exc}"})
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def system_figures(args, system, rows: list[dict]) -> None:
    llm = getattr(system, "llm", None)  # ours; transformers' model carries its config
    vocab = llm.engine.model_config.vocab_size if llm else system.model.config.vocab_size
    prompts = Prompts(vocab)  # token ids valid for this model
    system.prefill(prompts.make(256))  # warm-up: CUDA context, kernels' first launches
    for tokens in args.prefill:
        samples = [system.prefill(prompts.make(tokens)) for _ in range(args.repeats)]
        rows.append(row(system, "prefill", 1, tokens, samples, tokens))
    for batch in args.batches:
        samples = [
            system.decode([prompts.make(128) for _ in range(batch)], args.decode_steps)
            for _ in range(args.repeats)
        ]
        rows.append(row(system, "decode", batch, 128, samples, batch))


def staging_figures(args) -> list[dict]:
    """The host staging's copies for one `tokens`-token prompt of SmolLM2-135M's shape
    (30 layers, 3 KV heads of 64, bf16, 16-token blocks, scattered block ids): device -> host
    per layer (prefill side) and host -> device for all layers (decode side)."""
    from pdserve.serving.kv_staging import HostStaging

    rows = []
    for tokens in args.staging_tokens:
        n = -(-tokens // 16)
        shape = (4 * n, 16, 3, 64)
        k = [torch.randn(shape, dtype=torch.bfloat16, device=args.device) for _ in range(30)]
        v = [torch.randn(shape, dtype=torch.bfloat16, device=args.device) for _ in range(30)]
        staging = HostStaging(k, v, num_blocks=n)
        ids = list(range(0, 4 * n, 4))  # every fourth block: no contiguous runs
        host_s, device_s = [], []
        for i in range(args.repeats + 1):
            staging.take(str(i), n)
            t = time.perf_counter()
            for layer in range(30):
                staging.to_host(str(i), layer, ids)
            host_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            staging.to_device(str(i), ids)
            if args.device == "cuda":
                torch.cuda.synchronize()
            device_s.append(time.perf_counter() - t)
            staging.release(str(i))
        nbytes = 2 * 30 * n * 16 * 3 * 64 * 2
        for what, samples in (("to_host, 30 layers", host_s[1:]), ("to_device", device_s[1:])):
            sec = statistics.median(samples)
            rows.append({"tokens": tokens, "copy": what, "bytes": nbytes, "median_s": sec,
                         "gb_per_s": nbytes / sec / 1e9})  # fmt: skip
            print(f"staging {tokens:>5} tokens {what:<18} {sec * 1e3:8.2f} ms "
                  f"{nbytes / sec / 1e9:6.2f} GB/s", flush=True)  # fmt: skip
    return rows


def row(system, workload: str, batch: int, tokens: int, samples: list[float], n: int) -> dict:
    sec = statistics.median(samples)
    r = {"system": system.system, "workload": workload, "batch": batch, "tokens": tokens,
         "median_s": sec, "samples_s": samples, "tokens_per_s": n / sec}  # fmt: skip
    print(f"{r['system']:<13} {workload:<8} batch {batch:>4} tokens {tokens:>5}  "
          f"{sec * 1e3:9.2f} ms  {r['tokens_per_s']:10.0f} tok/s", flush=True)  # fmt: skip
    return r


def serve_figures(args, model: str | None, out: Path) -> list[dict]:
    rows = []
    for spec in args.modes.split(","):
        mode, _, workers = spec.partition(":")  # colocated:2 = two co-located workers
        extra = ["--device", args.device, *(["--model", model] if model else [])]
        extra += ["--colocated-workers", workers or "1"] if mode == "colocated" else []
        name = spec.replace(":", "-")
        with server(mode, *extra, log_dir=out) as url:
            chat = httpx.post(f"{url}/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 16})  # fmt: skip
            chat.raise_for_status()
            bench_dir = out / f"bench-{name}"
            subprocess.run([*PDSERVE, "bench", "--url", url, "--workload", args.workload,
                            "--rate", str(args.rate), "--num-requests", str(args.num_requests),
                            "--out", str(bench_dir), "--no-progress"], check=True)  # fmt: skip
            kv = {m: metric(url, m) for m in ("pdserve_kv_transfer_bytes_total",
                                              "pdserve_kv_transfer_seconds_total")}  # fmt: skip
        agg = json.loads((bench_dir / "results.json").read_text())["runs"][0]["aggregates"]
        rows.append({"mode": name, "chat": chat.json()["choices"][0]["message"]["content"],
                     "aggregates": agg, "kv": kv})  # fmt: skip
        print(f"{name:<10} rate {args.rate:g}: TTFT p50 {agg['ttft_s']['p50']:.3f} "
              f"p90 {agg['ttft_s']['p90']:.3f} s, TPOT p50 {agg['tpot_s']['p50'] * 1e3:.1f} "
              f"p90 {agg['tpot_s']['p90'] * 1e3:.1f} ms, {kv}", flush=True)  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or HF folder (default: the bundled model)")
    ap.add_argument(
        "--random-weights",
        type=Path,
        metavar="DIR",
        help="run on random weights of DIR/config.json (written into DIR once)",
    )
    ap.add_argument("--prefill", type=int, nargs="+", default=[512, 2048, 8000])
    ap.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[1, 16, 64],
        help="decode batch sizes (at most the engine's --max-num-seqs, 64)",
    )
    ap.add_argument("--staging-tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0)
    ap.add_argument(
        "--modes",
        default="colocated,colocated:2,disagg",
        help="serving runs; colocated:N = N co-located workers on the GPU",
    )
    ap.add_argument("--workload", default="mixed")
    ap.add_argument("--rate", type=float, default=8.0, help="requests/s for the serving runs")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--skip", default="", help="comma-separated: engine, staging, serve")
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA GPU is visible: this script checks the GPU path")
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.random_weights:
        write_random_weights(args.random_weights)
        model = str(args.random_weights)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    record = {"gpu": gpu, "torch": torch.__version__, "model": model,
              "random_weights": bool(args.random_weights)}  # fmt: skip
    print(json.dumps(record), flush=True)
    skip = set(args.skip.split(","))
    for name, fn in (("engine", lambda: engine_figures(args, model)),
                     ("staging", lambda: staging_figures(args)),
                     ("serve", lambda: serve_figures(args, model, args.out))):  # fmt: skip
        if name in skip:
            continue
        try:
            record[name] = fn()
        except Exception as exc:  # record what failed and go on to the next part
            record[name + "_error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name} failed: {record[name + '_error']}", flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(record, indent=1))
    return 1 if any(k.endswith("_error") for k in record) else 0


if __name__ == "__main__":
    sys.exit(main())
