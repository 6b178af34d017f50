"""Rows up to which a quantized kernel beats the dense GEMM: measured on this machine, once per
weight shape, format, dtype and thread count, and cached.

The crossover moves with the CPU and the thread count: the 16 rows of int4 were measured on
the AMD EPYC of an earlier session; on a Zen 5 EPYC (AVX512-BF16) the dense bf16 GEMM already
won from 8-16 rows at two threads and from 4-8 at one, and on CPUs with AMX, where oneDNN's
bf16 GEMM runs on tile instructions, it is expected to win sooner still. So no constant found
on one CPU decides it: the first engine that quantizes a shape here times both kernels at a
ladder of row counts, over every layer's weight of that shape in turn as a step reads them
(one weight timed alone stays in L2, which flatters the dense GEMM's 4x the bytes), and keeps
the largest count up to which the quantized kernel is the faster at every count (a few
seconds for a model; then read from
`$PDSERVE_CACHE_DIR/kernels/<machine key>.json`, where the key covers the CPU's feature flags,
torch's version and build, the dtype and the thread count). `PDSERVE_QUANT_MAX_ROWS` fixes
the limit for every shape instead (reproducible runs, tests).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from pdserve import envs
from pdserve.model.extension import cpu_flags

log = logging.getLogger(__name__)
VERSION = 10  # of the measurement (10: AMX partial tiles padded per thread); new: re-measured
LADDER = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # row counts timed, in order
MIN_CALLS, MAX_CALLS = 20, 400  # timed calls of each kernel per row count
BUDGET_S = 0.1  # beyond MIN_CALLS, time spent per row count
MARGIN = 0.97  # the quantized kernel must be at least 3 % faster to be chosen
# row counts timed for int8 activations (model/act_quant.py), and "every count" past its top
A8_LADDER = (*LADDER, 128, 256, 512, 1024)
ALL_ROWS = 1 << 30
# a fresh prompt's query counts timed for its causal attention (`measure_prompt_attention`)
ATTENTION_LADDER = (128, 256, 512, 1024, 2048)


def machine_key(dtype: torch.dtype, threads: int) -> str:
    from pdserve.model.quant import PACK_DENSE  # the dense GEMM timed: packed or F.linear's

    key = f"{VERSION}|{cpu_flags()}|{torch.__version__}|{torch.__file__}|{dtype}|{threads}"
    key += "" if PACK_DENSE else "|F.linear"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def table_path(dtype: torch.dtype, threads: int) -> Path:
    return envs.cache_dir() / "kernels" / f"{machine_key(dtype, threads)}.json"


def _best_pair_us(
    quantized, dense, x: torch.Tensor, min_calls: int = MIN_CALLS
) -> tuple[float, float]:
    """The least time of each kernel over calls made in turn (q, d, q, d, ...): a burst of
    load on a shared machine slows both, and noise only ever adds, so the least is the
    kernel's own time. At least `min_calls` of each, then until BUDGET_S has passed."""
    quantized(x), dense(x)  # the first calls may pick or build the kernels
    best_q = best_d = float("inf")
    start, calls = time.perf_counter(), 0
    while calls < min_calls or (time.perf_counter() - start < BUDGET_S and calls < MAX_CALLS):
        t0 = time.perf_counter()
        quantized(x)
        t1 = time.perf_counter()
        dense(x)
        t2 = time.perf_counter()
        best_q, best_d = min(best_q, t1 - t0), min(best_d, t2 - t1)
        calls += 1
    return best_q * 1e6, best_d * 1e6


def measure(dense, quantized, in_features: int, dtype: torch.dtype) -> int:
    """The largest row count of LADDER up to which `quantized(x)` beats `dense(x)` at every
    count (0: never); the ladder stops once the dense GEMM has won twice."""
    best, losses = 0, 0
    for rows in LADDER:
        x = torch.randn(rows, in_features).to(dtype)
        q_us, d_us = _best_pair_us(quantized, dense, x)
        if q_us < d_us * MARGIN and losses == 0:
            best = rows
        else:
            losses += 1
            if losses == 2:
                break
    return best


def measure_amx(few_rows, amx, in_features: int, dtype) -> int:
    """The fewest rows of LADDER from which a quantized kernel on AMX tiles (`amx(x)`) beats
    its few-row VNNI kernel (`few_rows(x)`) at every larger count; quant.NEVER: at none. (A Xeon
    with AMX, SmolLM2's 30 layers, 2 threads: the AMX kernel takes ~6 ms at 1-16 rows, where
    unpacking the weights to bf16 is most of it, and 13 at 64; the VNNI one 1.9 at 1, 6.6 at
    16 and 24 at 64.)"""
    from pdserve.model.quant import NEVER

    def race(rows: int) -> tuple[float, float]:
        return _best_pair_us(amx, few_rows, torch.randn(rows, in_features).to(dtype), 5)

    return _wins_from(LADDER, race, NEVER)


def _wins_from(ladder, race, never: int) -> int:
    """The fewest counts of `ladder` from which a challenger wins `race(count)` ((its us, the
    incumbent's us)) at every larger count; `never` where it loses at the top."""
    first = never
    for count in reversed(ladder):
        challenger_us, incumbent_us = race(count)
        if challenger_us >= incumbent_us * MARGIN:
            break
        first = count
    return first


def measure_a8(dense, a8, q_rows: int, in_features: int, dtype) -> tuple[int, int]:
    """(first, last rows of int8 activations) above the quantized kernel's `q_rows`: every
    count of A8_LADDER above them is timed (a few rows may favour
    the dense GEMM, whose fixed cost is lower, and many rows int8), and int8 activations get
    the longest run of counts where they beat it (to `ALL_ROWS` when the run reaches the
    ladder's top; (0, 0): none). A timing here runs one weight again and again, from
    the cache; a model's step streams every layer's weights from memory, where int4's half
    the bytes of int8 win the few-row steps that int8 wins here (SmolLM2, 1 row, Zen 5:
    int8 activations 25 vs int4 39 us timed alone, yet decode 141-161 vs 177-203 tok/s), so
    int8 never takes rows from the quantized kernel."""
    counts = [r for r in A8_LADDER if r > q_rows]  # never below them: see the docstring
    wins = []
    for rows in counts:
        x = torch.randn(rows, in_features).to(dtype)
        a_us, d_us = _best_pair_us(a8, dense, x, min_calls=3 if rows > 64 else MIN_CALLS)
        wins.append(a_us < d_us * MARGIN)
    best = _longest_run(wins)
    if best is None:
        return 0, 0
    first = counts[best[0] - 1] + 1 if best[0] > 0 else q_rows + 1
    last = ALL_ROWS if best[1] == len(counts) else counts[best[1] - 1]
    return first, last


def _longest_run(wins: list[bool]) -> tuple[int, int] | None:
    """[start, end) of the longest run of True in `wins` (the first of equals); None: none."""
    best, run = None, None
    for i, won in enumerate([*wins, False]):
        if won and run is None:
            run = i
        elif not won and run is not None:
            if best is None or i - run > best[1] - best[0]:
                best = (run, i)
            run = None
    return best


def measure_split(layer, in_features: int, dtype) -> list[int]:
    """The counts of SPLIT_LADDER at which `layer`'s packed GEMM runs faster as one slice of
    the rows per thread side by side (`Dense.row_parts_mm`) than whole, oneDNN threading it
    (quant.py `Dense.dense_mm`). Empty on one thread."""
    from pdserve.model.quant import SPLIT_LADDER

    if torch.get_num_threads() < 2:
        return []
    wins = []
    for rows in SPLIT_LADDER:
        x = torch.randn(rows, in_features).to(dtype)
        # dense_mm runs whole: the layer's split_rows are still empty
        parts_us, whole_us = _best_pair_us(layer.row_parts_mm, layer.dense_mm, x, min_calls=5)
        if parts_us < whole_us * MARGIN:
            wins.append(rows)
    return wins


def measure_prompt_attention(n_heads: int, n_kv: int, head_dim: int, dtype) -> list[int]:
    """[first, last] queries of a prompt chunk whose causal attention runs
    `attention.prompt_causal` (the C++ kernel, else blockwise matmuls) rather than torch's
    SDPA: the longest run of ATTENTION_LADDER's counts where a fresh prompt's beats SDPA's (last
    ALL_ROWS when the run reaches the top); [ALL_ROWS, ALL_ROWS]: never. A range, not a floor:
    the kernel holds a block's whole score rows, SDPA's flash loop does not, and on a Xeon with
    AMX the kernel won 1.2-1.4x from 128 to 1,024 queries and lost at 2,048."""
    from pdserve.model import attention

    wins = []
    for n in ATTENTION_LADDER:
        q = torch.randn(n, n_heads, head_dim).to(dtype)
        k, v = (torch.randn(n, n_kv, head_dim).to(dtype) for _ in range(2))
        kernel_us, sdpa_us = _best_pair_us(
            lambda x: attention.prompt_causal(*x), lambda x: attention.sdpa_causal(*x), (q, k, v), 5
        )
        wins.append(kernel_us < sdpa_us * MARGIN)
    best = _longest_run(wins)
    if best is None:
        return [ALL_ROWS, ALL_ROWS]
    last = ALL_ROWS if best[1] == len(wins) else ATTENTION_LADDER[best[1] - 1]
    return [ATTENTION_LADDER[best[0]], last]


class KernelRows:
    """This machine's table: (format, N, K) -> max rows, measured on first use and saved."""

    def __init__(self, dtype: torch.dtype, threads: int | None = None) -> None:
        self.dtype = dtype
        self.threads = threads or torch.get_num_threads()
        self.path = table_path(dtype, self.threads)
        self.fixed = envs.quant_max_rows()
        self.table: dict[str, int | list[int]] = {}
        if self.path.exists():
            try:
                self.table = json.loads(self.path.read_text())["max_rows"]
            except (OSError, ValueError, KeyError):
                log.warning("ignoring an unreadable kernel table at %s", self.path)
        self.measured: list[str] = []  # shapes measured by this process

    def max_rows(self, fmt: str, layer, peers: list | None = None) -> int:
        """For the quantized linear `layer` (a quant._Quantized of `fmt`). `peers`: the
        model's linears of its shape and format (`layer` among them), timed one after another
        as a step runs them, so each kernel reads its weights from where a step finds them
        (one weight timed alone stays in L2: on a Xeon with AMX that put the crossover at
        8-12 rows for three of SmolLM2's shapes, where decode steps of 16 ran 15 % faster on
        int4 throughout)."""
        if self.fixed is not None:
            return self.fixed
        n, k = layer.shape
        peers = peers or [layer]

        def dense(x: torch.Tensor) -> None:
            for peer in peers:
                peer.dense_mm(x)

        def quantized(x: torch.Tensor) -> None:
            for peer in peers:
                peer.quantized_mm(x)

        return self._entry(f"{fmt}:{n}x{k}", lambda: measure(dense, quantized, k, self.dtype),
                           "quantized kernel up to {} rows on this machine")  # fmt: skip

    def amx_from(self, fmt: str, layer, peers: list | None = None) -> int:
        """Rows from which the quantized linear `layer` (few_rows.h's int4 or int8 kind,
        `peers` as for max_rows) runs its AMX kernel (`measure_amx`); quant.NEVER where the
        extension has none here, or the rows are fixed (`PDSERVE_QUANT_MAX_ROWS`: the few-row
        kernel throughout)."""
        from pdserve.model.quant import NEVER

        ext = getattr(layer, "ext", None)
        if self.fixed is not None or ext is None or not ext.amx_available():
            return NEVER
        n, k = layer.shape
        peers = peers or [layer]

        mm = ext.few_rows_mm if fmt == "int4" else ext.few_rows_mm8

        def kernel(amx_from: int):
            return lambda x: [mm(x, *peer.tensors, amx_from) for peer in peers]

        return self._entry(f"amx:{fmt}:{n}x{k}",
                           lambda: measure_amx(kernel(NEVER), kernel(1), k, self.dtype),
                           "the AMX kernel from {} rows")  # fmt: skip

    def a8_rows(self, fmt: str, layer) -> tuple[int, int]:
        """(first, last rows of int8 activations) for the quantized linear `layer` with its
        int8 activations (`layer.a8`), above its quantized kernel's rows: see measure_a8."""
        q_rows = self.max_rows(fmt, layer)
        fixed_a8 = envs.int8_act_rows()
        if self.fixed is not None or fixed_a8 is not None:
            return (q_rows + 1, fixed_a8) if fixed_a8 else (0, 0)
        n, k = layer.shape
        first, last = self._entry(
            f"int8act:{fmt}:{n}x{k}",
            lambda: measure_a8(layer.dense_mm, layer.a8, q_rows, k, self.dtype),
            "int8 activations from {0[0]} to {0[1]} rows",
        )
        return first, last

    def split_rows(self, layer) -> tuple[int, ...]:
        """For a packed linear `layer`: the row counts at which its GEMM runs as row parts
        (`measure_split`; none where the C++ extension is not loaded)."""
        from pdserve.model.extension import loaded_or_none

        if loaded_or_none() is None:
            return ()
        n, k = layer.shape
        wins = self._entry(f"split:{n}x{k}", lambda: measure_split(layer, k, self.dtype),
                           "the GEMM as row parts at {} rows")  # fmt: skip
        return tuple(wins)

    def prompt_kernel_queries(self, n_heads: int, n_kv: int, head_dim: int) -> tuple[int, int]:
        """(first, last) queries of a prompt chunk whose attention runs `prompt_causal` rather
        than SDPA (`measure_prompt_attention`), for this rank's heads."""
        first, last = self._entry(
            f"attention:{n_heads}x{n_kv}x{head_dim}",
            lambda: measure_prompt_attention(n_heads, n_kv, head_dim, self.dtype),
            "prompt attention's own kernel at [first, last] queries {}",
        )
        return first, last

    def _entry(self, name: str, make, what: str):
        """The table's `name`, made by `make()` (a measurement) the first time and logged as
        `what` (formatted with the value)."""
        if name not in self.table:
            start = time.perf_counter()
            self.table[name] = make()
            self.measured.append(name)
            log.info("%s: %s (measured in %.1f s)",
                     name, what.format(self.table[name]), time.perf_counter() - start)  # fmt: skip
        return self.table[name]

    def save(self) -> None:
        """Write the table if this process measured anything (atomically: engines that start
        together each write a whole table, the last one stays)."""
        if not self.measured:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        body = {"threads": self.threads, "dtype": str(self.dtype), "max_rows": self.table}
        tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
        tmp.replace(self.path)


def main(argv: list[str] | None = None) -> None:
    """`python -m pdserve.model.kernel_rows`: measure (or re-measure) this machine's table for
    a model now, as `make install` does for the bundled one, so no worker start waits for it."""
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m pdserve.model.kernel_rows", description=main.__doc__
    )
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled)")
    ap.add_argument("--threads", default=None,
                    help="comma-separated thread counts (default: 1 and every core)")  # fmt: skip
    ap.add_argument("--remeasure", action="store_true", help="forget the cached tables first")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from pdserve.model import act_quant, quant
    from pdserve.model.extension import extension_or_none
    from pdserve.model.llama import LlamaModel
    from pdserve.model.loader import load_int4_blocks, load_model_files

    cores = len(os.sched_getaffinity(0))
    threads = sorted({int(t) for t in args.threads.split(",")} if args.threads else {1, cores})
    files, cpu, dtype = load_model_files(args.model), torch.device("cpu"), torch.bfloat16
    blocks = load_int4_blocks(files)
    fmt = quant.resolve_format("auto", cpu, blocks, dtype)
    model = LlamaModel(files.config, files.weights, dtype, cpu)
    quant.quantize_model(model, fmt, blocks)
    for n in threads:
        torch.set_num_threads(n)
        if args.remeasure:
            table_path(dtype, n).unlink(missing_ok=True)
        rows = KernelRows(dtype, n)
        quant.set_kernel_rows(model, rows)
        extension_or_none()  # serving loads it: its prompt attention is timed, not blockwise's
        rows.prompt_kernel_queries(model.n_heads, model.n_kv, files.config.head_dim)
        quant.set_split_rows(model, rows)
        if act_quant.supported():  # the timings need no calibration: any smoothing will do
            for lin in quant.quantized_linears(model):
                lin.a8 = act_quant.Int8Activations(lin.weight, None)
                rows.a8_rows(lin.format, lin)
        rows.save()
        print(f"{fmt}, {n} thread(s): {table_path(dtype, n)}", flush=True)
    torch.set_num_threads(cores)


if __name__ == "__main__":
    main()
