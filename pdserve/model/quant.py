"""Quantized linear layers (int4 / int8 weights), applied to a built model as a transform (as
gpt-fast does): the model calls `layer.attn.qkv(x)` and never sees the format.

A decode step at small batch reads every weight once per step, so its time is the weights'
bytes over DRAM bandwidth; fewer bytes per weight is the speed-up. Formats:

* `int4`: groups of 32 input columns share a scale and a zero; x @ ((q - 8) * scale + zero).T
  with q in [0, 16), by pdserve's few-row kernel (csrc/few_rows.h, for bf16 models where the
  C++ extension builds: the rows quantized to int8 groups of 32 as llama.cpp's Q8 activations,
  the products summed exactly in int32 by VNNI; from `amx_from` rows, where the CPU has AMX,
  each group of weights unpacked to bf16 once for every row and multiplied on the tile unit:
  a big decode batch) or torch's `_weight_int4pack_mm_for_cpu`. GGUF's Q4_0 and Q4_1 blocks
  are exactly this (32 wide; Q4_1 stores w = d * q + m, so
  scale = d and zero = m + 8 d; Q4_0 stores w = d * (q - 8), so zero = 0): they are packed as
  the file has them, never expanded and re-quantized. Other weights get min/max groups.
* `int8`: one symmetric scale per output row (few_rows.h's, or torch's `_weight_int8pack_mm`).

The few-row kernels unpack each tile of weights once for every row of the input, so a step of
1 + k rows (speculation's verify, a small batch) costs little more than one row; torch's cost
nearly k + 1 times one (Zen 5, 2 threads, gate_up 3072 x 576: 37 / 85 / 244 us at 1 / 5 / 16
rows against torch's 53 / 211 / 400; the int8 lm_head 1.0 / 1.9 ms at 1 / 5 rows against
2.4 / 4.6). Each row's result is the same bits whatever the rows beside it.

Every quantized linear keeps its dense weight too and uses it for inputs of more than its
`max_rows` rows: the int4/int8 kernels stream weights fast for a few rows, but compute slower
than the dense GEMM. Where that crossover lies depends on the CPU, so it is measured per
machine and weight shape (`model/kernel_rows.py`). For scale: on an AMD EPYC (SmolLM2's 30
layers of linears, 2 threads) bf16 / int8 / int4 took, in ms, 9.4 / 4.0 / 2.4 at 1 row;
bf16 / int4: 10.4 / 6.0 at 8 rows, 12.1 / 10.9 at 16, 14.0 / 15.8 at 24; the lm_head
(49,152 x 576), bf16 / int8: 1.81 / 0.58 at 1 row, 2.45 / 3.19 at 16. On a Zen 5 EPYC the
dense GEMM won from 8-16 rows with torch's kernels (gate_up at 16 rows: 123 vs 219 us), from
16-48 with the few-row ones.
Above those rows, `--int8-activations on` (model/act_quant.py) runs int8 GEMMs instead of the
dense copy where this machine runs them faster: prefills and big decode batches.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.model.gguf_file import Int4Blocks

log = logging.getLogger(__name__)

GROUP = 32  # int4 group width: GGUF's block width, and gpt-fast's default
NEVER = 1 << 62  # a row count no input reaches (a kernel's "from" when it never runs)
# A linear built on its own (not by quantize_model, which measures this machine) uses its
# quantized kernel up to these rows: the AMD EPYC crossovers above.
MAX_ROWS = {"int4": 16, "int8": 8}
FEW_ROWS_TILE = 16  # output columns per tile of the few-row int4 kernel (csrc/few_rows.h)


class Dense:
    """y = x @ weight.T in the model's dtype.

    On CPU in bf16 the weight is held in oneDNN's blocked layout once built (`pack_dense`):
    `F.linear` hands oneDNN the plain (N, K) weight and it reorders all of it on every call,
    which is most of a small batch's time (Zen 4, 2 threads, gate_up 3072 x 576: 137 / 287 /
    8,874 us at 1 / 16 / 1,024 rows against 49 / 154 / 8,226 prepacked; the lm_head 49,152 x
    576 at 16 rows 5.9 vs 2.6 ms). Both sum in float32 and round once to bf16; on that Zen 4
    they gave the same bits at every shape tested (another CPU's oneDNN may order the sums
    otherwise: eager and fused steps both run the packed op, so they still agree)."""

    format = "bf16"
    # the fused step's `Linear` kind (csrc/decode.cpp): 0 dense, 1 int4, 2 int8, 3 int4 few-row
    kind = 0

    max_rows = 0  # rows up to which the quantized kernel runs; the dense weight above
    # Row counts of SPLIT_LADDER at which the packed GEMM runs as one part of the
    # rows per thread, side by side (`split_here`), measured on this machine; none: whole.
    split_rows: tuple[int, ...] = ()

    def __init__(self, weight: torch.Tensor):
        self._weight = weight  # (N, K), or oneDNN's layout of it once packed
        self.shape = tuple(weight.shape)

    @property
    def onednn(self) -> bool:
        """Whether the weight is held in oneDNN's layout (`pack_dense`)."""
        return self._weight.is_mkldnn

    @property
    def weight(self) -> torch.Tensor:
        """The (N, K) weight (a plain copy when packed: for set-up, not for steps)."""
        return self._weight.to_dense() if self.onednn else self._weight

    def pack(self) -> None:
        """Hold the weight in oneDNN's layout, where it runs (bf16 on CPU; see the class)."""
        if not self.onednn and onednn_packs(self._weight):
            self._weight = torch.ops.mkldnn._reorder_linear_weight(self._weight, 16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_mm(x)

    def dense_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            if self.split_rows and split_here(x.shape[0], self.split_rows) and x.dim() == 2:
                return self.row_parts_mm(x)
            return _onednn_linear(x, self._weight, None, "none", [], "")
        return F.linear(x, self._weight)

    def row_parts_mm(self, x: torch.Tensor) -> torch.Tensor:
        """The packed GEMM as one slice of x's rows per thread, side by side (the C++
        extension's `onednn_row_parts`, loaded: else whole)."""
        from pdserve.model.extension import loaded_or_none

        if (ext := loaded_or_none()) is None:
            return _onednn_linear(x, self._weight, None, "none", [], "")
        return ext.onednn_row_parts(x, self._weight, torch.get_num_threads())

    @property
    def packed(self) -> tuple[torch.Tensor, ...]:
        """The quantized kernel's tensors (none for a dense linear)."""
        return ()

    def kernel_spec(self) -> tuple:
        """(kind, max_rows, [weight, *packed], first and last rows of int8 activations,
        [their tensors], rows from which the int4 / int8 kernel runs on AMX) for the fused decode
        step's `Linear` (the weight as held: plain, or in oneDNN's layout)."""
        return self.kind, self.max_rows, [self._weight, *self.packed], 0, 0, [], NEVER


# prompt row counts at which a packed GEMM is timed whole and as row parts
# (kernel_rows.measure_split)
SPLIT_LADDER = (256, 512, 768, 1024, 1536, 2048)


def split_here(rows: int, wins: tuple[int, ...]) -> bool:
    """Whether `rows` rows run as row parts, given the ladder counts `wins` where that won
    (sorted): the counts on both sides of `rows` must have won (past the ladder's top, the top;
    below its first, never)."""
    if rows < wins[0]:
        return False
    below = max((r for r in SPLIT_LADDER if r <= rows), default=0)
    above = min((r for r in SPLIT_LADDER if r >= rows), default=SPLIT_LADDER[-1])
    return below in wins and above in wins


# Whether bf16 weights on this CPU can be held in oneDNN's layout: None until first asked.
_ONEDNN_BF16: bool | None = None
PACK_DENSE = True  # tests turn it off to compare with F.linear on the plain weight


_LINEAR_POINTWISE = None  # torch.ops.mkldnn._linear_pointwise.default, once looked up


def _onednn_linear(*args):
    global _LINEAR_POINTWISE
    if _LINEAR_POINTWISE is None:
        _LINEAR_POINTWISE = torch.ops.mkldnn._linear_pointwise.default
    return _LINEAR_POINTWISE(*args)


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether `weight` runs held in oneDNN's layout: bf16 on an x86 CPU with bf16 instructions
    (AVX512-BF16 or AMX, where it was measured), whose torch has the ops and gives a small
    weight's product within bf16 rounding of `F.linear`'s. Float32 runs MKL's GEMM; CPUs that
    would emulate bf16 keep `F.linear`."""
    global _ONEDNN_BF16
    if not PACK_DENSE or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return False
    if _ONEDNN_BF16 is None:
        _ONEDNN_BF16 = _onednn_bf16_works()
    return _ONEDNN_BF16


def _onednn_bf16_works() -> bool:
    from pdserve.model.extension import cpu_flags

    if not {"avx512_bf16", "amx_bf16"} & set(cpu_flags().split()):
        return False
    try:
        w = torch.linspace(-1, 1, 32 * 64).reshape(32, 64).to(torch.bfloat16)
        x = torch.linspace(1, -1, 3 * 64).reshape(3, 64).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        got = _onednn_linear(x, packed, None, "none", [], "")
        return torch.allclose(got.float(), F.linear(x, w).float(), rtol=2**-7, atol=1e-2)
    except (AttributeError, RuntimeError) as exc:  # a torch built without the ops, or failing
        log.warning("dense bf16 weights stay with F.linear: oneDNN's packed GEMM failed (%s)", exc)
        return False


def pack_dense(model) -> None:
    """Hold every dense weight of `model` (the quantized linears' dense copies too, and the
    lm_head) in oneDNN's layout where that runs here. A quantized lm_head
    whose weight is the (tied) embeddings' keeps it plain: packing would copy the whole
    embedding table (vocab x hidden) for the few prompt rows it takes."""
    head = model.lm_head
    tied = head is not None and isinstance(head, _Quantized) and head._weight is model.embed
    linears = [*model.linears(), *([head] if head is not None and not tied else [])]
    for linear in linears:
        linear.pack()


# True while a step computes prompt tokens (model/llama.py): their K/V is read by every later
# token, so their rows keep bf16 precision (the dense GEMM) rather than the few-row kernels'
# int8 rows. The first token of "What is the capital of France?" is a near tie ("The" 0.13
# nats ahead of "L'" with bf16 rows) that int8 rows over the 37-token prompt flipped.
# benchmarks/quality.py sets FEW_ROWS_FOR_PROMPTS to score the decode kernels on held text.
_PROMPT = contextvars.ContextVar("pdserve_prompt_rows", default=False)
FEW_ROWS_FOR_PROMPTS = False


@contextlib.contextmanager
def prompt_rows(prompt: bool):
    """While `prompt`, quantized linears leave their few-row kernels to the dense weight."""
    token = _PROMPT.set(prompt and not FEW_ROWS_FOR_PROMPTS)
    try:
        yield
    finally:
        _PROMPT.reset(token)


class _Quantized(Dense):
    """A quantized kernel for inputs of up to `max_rows` rows; above, int8 activations (`a8`,
    model/act_quant.py) up to `a8_rows` rows when the model has them, the dense weight beyond."""

    a8 = None  # act_quant.Int8Activations, once calibrated
    a8_rows = (0, 0)  # the first and last row counts it runs
    amx_from = NEVER  # rows from which few_rows.h's int4 / int8 kinds run on AMX tiles
    calib_amax = None  # while calibrating: the largest |x| per input channel seen

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.max_rows = MAX_ROWS[self.format]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.calib_amax is not None:
            torch.maximum(self.calib_amax, x.detach().abs().amax(0).float(), out=self.calib_amax)
            return self.dense_mm(x)
        if rows <= self.max_rows and not _PROMPT.get():
            return self.quantized_mm(x)
        if self.a8_rows[0] <= rows <= self.a8_rows[1]:
            return self.a8(x)
        return self.dense_mm(x)

    def kernel_spec(self):
        dense = [self._weight, *self.packed]
        if self.a8 is None or not self.a8_rows[1]:
            return self.kind, self.max_rows, dense, 0, 0, [], self.amx_from
        return self.kind, self.max_rows, dense, *self.a8_rows, self.a8.tensors, self.amx_from

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int4Linear(_Quantized):
    """Int4 groups of 32. In bf16, with the C++ extension built and N a multiple of 16, its
    few-row kernel (csrc/few_rows.h: a verify step of 1 + k rows costs little more than one
    row), and from `amx_from` rows its AMX kernel (each group of weights unpacked to bf16 once
    for every row: a big decode batch) where the CPU has AMX; else torch's int4 kernel."""

    format = "int4"

    def __init__(self, weight: torch.Tensor, blocks: Int4Blocks | None = None):
        super().__init__(weight)
        # the file's own 4-bit blocks: the dense weight holds their values (the kernel's scales
        # rounded to bf16), so a prompt's rows may take them on bf16 rows (model_runner
        # `_fused_prompt_rows`)
        self.stored = blocks is not None
        blocks = blocks if blocks is not None else int4_blocks(weight)
        self.ext = few_rows_extension(weight)
        if self.ext is not None:
            self.kind, self.tensors = 3, pack_few_rows(blocks, weight.dtype)
            return
        q = torch.from_numpy(np.ascontiguousarray(blocks.q)).to(torch.int32)
        sz = np.stack([blocks.scale, blocks.zero], -1).transpose(1, 0, 2)  # (K // 32, N, 2)
        scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).to(weight.dtype)
        self.kind = 1
        self.tensors = (torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros)

    @property
    def packed(self) -> tuple[torch.Tensor, ...]:
        return self.tensors

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == 3:
            return self.ext.few_rows_mm(x, *self.tensors, self.amx_from)
        return torch._weight_int4pack_mm_for_cpu(x, self.tensors[0], GROUP, self.tensors[1])


def few_rows_extension(weight: torch.Tensor):
    """The extension whose few-row kernels can run `weight` (bf16, N a multiple of 16, K of
    32), or None (then torch's int4 / int8 kernel)."""
    if weight.dtype != torch.bfloat16 or weight.shape[0] % FEW_ROWS_TILE or weight.shape[1] % GROUP:
        return None
    from pdserve.model.extension import extension_or_none

    return extension_or_none()


def pack_few_rows(blocks: Int4Blocks, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`blocks` in csrc/few_rows.h's layout: q (N/16, K/32, 256) uint8, a group's 32 k's of
    a tile's 16 columns as 4 loads of 64 bytes, byte 4c + i of load j holding k = 8j + i of
    column c in its low nibble and 8j + 4 + i in its high one (so one and / shift gives
    vpdpbusd 4 k's a column); and sz (N/16, K/32, 2, 16): each group's scale and zero per
    column."""
    n, k = blocks.q.shape
    t = FEW_ROWS_TILE
    q = blocks.q.reshape(n // t, t, k // GROUP, 4, 2, 4)  # (tile, column, group, load, nibble, i)
    q = q[..., 0, :] | (q[..., 1, :] << 4)  # (tile, column, group, load, i)
    q = q.transpose(0, 2, 3, 1, 4).reshape(n // t, k // GROUP, 4 * t * 4)
    sz = np.stack([blocks.scale, blocks.zero], 0).reshape(2, n // t, t, k // GROUP)
    sz = sz.transpose(1, 3, 0, 2)  # (tiles, group, scale | zero, column)
    return (
        torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(sz, dtype=np.float32)).to(dtype),
    )


def int8_rows(weight: torch.Tensor, ext=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, K) int8, scale (N,) float32): each row's amax / 127 (at least 1e-12) and the row
    over it rounded half to even. By the extension's `quantize_rows` where loaded (the same bits
    in one pass on both threads: a 49,152 x 576 lm_head 4-34 ms against torch's 0.2-0.4 s, at
    every worker's start), else by torch."""
    if ext is not None:
        q, scale = ext.quantize_rows(weight.contiguous(), torch.ones(weight.shape[1]))
        return q, scale.view(-1)
    w = weight.float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


class Int8Linear(_Quantized):
    """Int8 per output channel. In bf16, with the C++ extension built and N a multiple of 16,
    its few-row kernel (csrc/few_rows.h); else torch's int8 kernel."""

    format = "int8"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.ext = few_rows_extension(weight)
        self.kind = 2 if self.ext is None else 4
        q, scale = int8_rows(weight, self.ext)
        if self.kind == 4:  # few_rows.h's: (N/16, K/4, 64) uint8, byte 4c + i = q[c, 4p + i] + 128
            n, k = q.shape
            q = q.view(torch.uint8) ^ 128  # + 128 as a byte: the sign bit flipped
            q = q.reshape(n // FEW_ROWS_TILE, FEW_ROWS_TILE, k // 4, 4).transpose(1, 2)
            q = q.reshape(n // FEW_ROWS_TILE, k // 4, 4 * FEW_ROWS_TILE).contiguous()
        self.tensors = (q, scale.to(weight.dtype))

    @property
    def q(self) -> torch.Tensor:
        """The int8 weight (N, K), whatever the kernel's layout."""
        q = self.tensors[0]
        if self.kind == 2:
            return q
        tiles, quads = q.shape[:2]
        q = q.reshape(tiles, quads, FEW_ROWS_TILE, 4).transpose(1, 2).reshape(-1, quads * 4)
        return (q.to(torch.int16) - 128).to(torch.int8)

    @property
    def scales(self) -> torch.Tensor:
        return self.tensors[1]

    @property
    def packed(self) -> tuple[torch.Tensor, ...]:
        return self.tensors

    def quantized_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == 4:
            return self.ext.few_rows_mm8(x, *self.tensors, self.amx_from)
        return torch._weight_int8pack_mm(x, *self.tensors)


def int4_blocks(weight: torch.Tensor) -> Int4Blocks:
    """Min/max int4 groups of 32 of a float weight (N, K) (gpt-fast's asymmetric scheme)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)  # (N, K // 32)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Int4Blocks(q.reshape(n, k).numpy(), scale.numpy(), (lo + 8 * scale).numpy())


# torch._weight_int8pack_mm reads its input in steps of 16: K = 24 or 40 segfaults (torch 2.x,
# measured here), 16, 32, 48 and 64 run
INT8_MULTIPLE = 16


def check_format(fmt: str, device: torch.device, in_features: int) -> None:
    """Raise ValueError saying what to do when `fmt` (one of config.WEIGHT_FORMATS) cannot
    run here."""
    if fmt in ("int4", "int8") and device.type != "cpu":
        raise ValueError(
            f"--weights {fmt} runs on CPU only (its kernels are torch's CPU ones); on "
            f"{device.type} use --weights bf16 or auto, where a step is not bound by weight bytes"
        )
    if fmt == "int8" and in_features % INT8_MULTIPLE:
        raise ValueError(
            f"--weights int8 needs every linear's input size divisible by {INT8_MULTIPLE} "
            f"(torch's int8 kernel crashes on others; this model has {in_features}); use "
            "--weights bf16"
        )
    if fmt == "int4" and in_features % GROUP:
        raise ValueError(
            f"--weights int4 needs every linear's input size divisible by {GROUP} "
            f"(this model has {in_features}); use --weights int8 or bf16"
        )


def resolve_format(
    fmt: str,
    device: torch.device,
    file_blocks: dict[str, Int4Blocks],
    dtype: torch.dtype = torch.bfloat16,
) -> str:
    """`auto`: on CPU int4 when the file's linear weights are 4-bit blocks already (packing
    them loses nothing), else int8 (within 1 % of the float perplexity); dense on GPUs, whose
    steps are not bound by weight bytes, and in float32, where torch's int4 and int8 kernels
    have no fast path (measured at 1 row, 1536 x 576: int4 1,238 us in float32 vs 23 us in
    bf16, dense float32 52 us; the int8 lm_head 17.3 ms vs dense 6.2 ms)."""
    if fmt != "auto":
        return fmt
    if device.type != "cpu" or dtype == torch.float32:
        return "bf16"
    return "int4" if file_blocks else "int8"


def quantize_linear(dense: Dense, fmt: str, blocks: Int4Blocks | None = None) -> Dense:
    if fmt == "int4":
        return Int4Linear(dense.weight, blocks)
    if fmt == "int8":
        return Int8Linear(dense.weight)
    return dense


def quantize_model(model, fmt: str, file_blocks: dict[str, Int4Blocks], rows=None) -> None:
    """Replace the linears of a built `LlamaModel` (each layer's `linears()`: attention,
    MLP, every expert) by `fmt` (int4 from the file's own 4-bit
    blocks where every part of a fused linear has them), and the lm_head by int8: it is
    usually stored as Q8_0 (GGUF) or float, and at 4 bits it would cost more quality than the
    layers do, for a fifth of the bytes. `rows` (a kernel_rows.KernelRows): this machine's
    crossover per shape, else each format's MAX_ROWS. Every dense weight left is then held
    in oneDNN's layout where that runs here (`pack_dense`), before the crossovers are timed
    against it."""
    if fmt != "bf16":
        for layer in model.layers:  # every linear of every part (experts too), by HF names
            for owner, attr, parts in layer.linears():
                have = [file_blocks.get(f"{part}.weight") for part in parts]
                blocks = Int4Blocks.concat(have) if all(b is not None for b in have) else None
                setattr(owner, attr, quantize_linear(getattr(owner, attr), fmt, blocks))
        if model.lm_head is not None:  # a later pipeline stage has none
            model.lm_head = Int8Linear(model.lm_head.weight)
    pack_dense(model)
    if rows is not None:
        set_kernel_rows(model, rows)


def quantized_linears(model, head: bool = True) -> list[_Quantized]:
    """Every quantized linear of `model`, the lm_head included unless not `head`."""
    linears = [*model.linears(), model.lm_head] if head else model.linears()
    return [x for x in linears if isinstance(x, _Quantized)]


def set_split_rows(model, rows) -> None:
    """Give each packed linear of `model`'s layers (quantized ones' dense copies too) the row
    counts at which its GEMM runs as row parts on this machine (`rows`: KernelRows)."""
    for linear in model.linears():
        if linear.onednn:
            linear.split_rows = rows.split_rows(linear)
    rows.save()


def set_kernel_rows(model, rows) -> None:
    """Give each quantized linear of `model` its shape's max_rows from `rows` (measuring the
    shapes it lacks, then saving it)."""
    linears = quantized_linears(model)
    peers: dict[tuple, list] = {}
    for linear in linears:
        peers.setdefault((linear.format, linear.shape), []).append(linear)
    for linear in linears:  # the AMX kernel first: it moves the crossover with the dense GEMM
        same = peers[linear.format, linear.shape]
        if linear.kind in (3, 4):  # few_rows.h's int4 / int8 kinds
            linear.amx_from = rows.amx_from(linear.format, linear, same)
    for linear in linears:
        linear.max_rows = rows.max_rows(linear.format, linear, peers[linear.format, linear.shape])
    rows.save()
