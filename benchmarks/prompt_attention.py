"""A prompt chunk's attention: the C++ kernel (csrc/prefill_attention.h) against the blockwise
torch path it replaces (model/attention.py `_blockwise_causal`) and torch's SDPA (`sdpa_causal`,
which an engine runs instead where it is the faster: `kernel_rows.measure_prompt_attention`),
SmolLM2's heads (9 query, 3 kv, head_dim 64) unless told otherwise, bf16, both threads. Fresh
prompts (queries = context) and chunks at a context's end; calls interleaved, medians; the
outputs' largest difference too.

    .venv/bin/python benchmarks/prompt_attention.py [--shapes 256:256,1000:1000,1024:2048]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def median_ms(fn, args: tuple, calls: int) -> float:
    fn(*args)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="37:37,256:256,1000:1000,100:356,256:1280,1024:2048",
                    help="queries:context pairs")  # fmt: skip
    ap.add_argument("--heads", default="9:3:64", help="query heads:kv heads:head_dim")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    from pdserve.model import attention
    from pdserve.model.extension import extension_or_none

    ext = extension_or_none()
    heads, kv, d = (int(x) for x in args.heads.split(":"))
    probe = torch.zeros(1, heads, d, dtype=torch.bfloat16)
    if ext is None or attention._prompt_kernel(probe) is None:
        raise SystemExit("no prompt kernel here: it needs the C++ extension and AVX512-BF16")
    print(f"heads {heads} / {kv}, head_dim {d}, bf16, {torch.get_num_threads()} threads")
    print("| queries | context | blockwise ms | SDPA ms | kernel ms | kernel vs blockwise | "
          "kernel vs SDPA | largest difference |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, ctx = (int(x) for x in shape.split(":"))
        g = torch.Generator().manual_seed(n + ctx)
        q = torch.randn(n, heads, d, generator=g).to(torch.bfloat16)
        k, v = (torch.randn(ctx, kv, d, generator=g).to(torch.bfloat16) for _ in range(2))
        diff = ext.prefill_attention(q, k, v).float() - attention._blockwise_causal(q, k, v)
        old = sdpa = new = 0.0
        for _ in range(3):  # interleaved rounds
            old += median_ms(attention._blockwise_causal, (q, k, v), args.calls)
            sdpa += median_ms(attention.sdpa_causal, (q, k, v), args.calls)
            new += median_ms(ext.prefill_attention, (q, k, v), args.calls)
        print(f"| {n} | {ctx} | {old / 3:.3f} | {sdpa / 3:.3f} | {new / 3:.3f} | {old / new:.2f}x "
              f"| {sdpa / new:.2f}x | {diff.abs().max().item():.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
