"""Int8 activations for steps of many rows (prefills, big decode batches) of a quantized model:
y = x @ W.T as one int8 x int8 GEMM (`torch._int_mm`, oneDNN's VNNI / AMX-int8 kernels) instead
of the dense bf16 copy, as SmoothQuant (W8A8) does it.

Per token, the activations get one scale (the row's max over 127); per output row, the weight
gets one. LLM activations have a few outlier channels, which quantized per token alone cost
SmolLM2-135M 4 % of perplexity on held text; SmoothQuant moves that range into the weight: a
channel j is divided by s_j = amax(x_j)^a / amax(W_:,j)^(1-a) in the activation and multiplied
into the weight's column, which leaves x @ W.T unchanged. amax(x_j) is calibrated once, at load,
on a built-in text (`calibration.txt`: prose, chat, code, SQL, JSON, a few languages), through
the dense weights. The calibration text is not what costs quality (2026-12-03: 40 KB of prose,
code and licences, or the held text's own first 20 KB, score within 0.5 % of each other).

The layers' linears get it, the lm_head does not (2026-12-05, SmolLM2 int4, perplexity on held
text, CPython docstrings, whole 512-token chunks per step, `benchmarks/quality.py`): the layers
in int8 cost +0.46 % over their dense copy (13.934 -> 13.998; bf16 weights 13.948), the lm_head
in int8 another +1.0 % (14.14). The lm_head runs few rows a step anyway (a prompt's last token,
one row a decode), which its few-row int8 kernel serves. Prefill chunks of 1,024 tokens run
~1.3x faster than on the dense copy (a Zen 4 EPYC, 2 threads: 840 -> 628 ms a chunk). It stays
off by default: the logits of a 400-token prompt of held text move 4x further from float32's
than bf16's do (mean |difference| 0.42 vs 0.10, argmax the same at 93 % vs 97 % of positions),
and most of that is the down projection (0.40 with int8 there alone; 0.23 with it left dense)
and the weights' per-row int8 grid (0.36 with exact activations). Splitting a row's channels
into 2-8 groups of their own scale, or keeping 8-128 outlier channels in bf16, gave 0.28-0.38.

Which rows run this kernel is measured per machine and shape with the quantized kernels'
crossover (`kernel_rows.py`): the few-row int4/int8 kernels (int8 groups of 32 per row) for a
few rows, this one above them while it beats the dense GEMM, the dense GEMM beyond. Off by
default (`--int8-activations on`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from pdserve.model.quant import int8_rows

log = logging.getLogger(__name__)
ALPHA = 0.7  # SmoothQuant's migration strength: see the module docstring for what it costs
CALIBRATION = Path(__file__).with_name("calibration.txt")


class Int8Activations:
    """A linear's W8A8 kernel: its weight smoothed by the calibrated input range and quantized
    per output row; `inv_smooth` divides the activations' channels before they are quantized."""

    def __init__(self, weight: torch.Tensor, amax: torch.Tensor | None, alpha: float = ALPHA):
        """`amax`: the calibrated largest |x| per input channel (None: no smoothing)."""
        w = weight.float()
        if amax is None:
            smooth = torch.ones(w.shape[1])
        else:
            smooth = amax.float().clamp(min=1e-5).pow(alpha)
            smooth = (smooth / w.abs().amax(0).clamp(min=1e-5).pow(1 - alpha)).clamp(min=1e-5)
        w = w * smooth
        self.q, self.scales = int8_rows(w)  # (N, K) int8, (N,) float32
        self.inv_smooth = smooth.reciprocal()  # (K,) float32

    @property
    def tensors(self) -> list[torch.Tensor]:
        """[q, scales, inv_smooth], as the fused decode step's `Linear` takes them."""
        return [self.q, self.scales, self.inv_smooth]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ext = _kernels()
        if ext is None or x.dtype not in (torch.float32, torch.bfloat16):
            return reference(x, self.q, self.scales, self.inv_smooth)
        xq, s = ext.quantize_rows(x, self.inv_smooth)
        return ext.dequantize_rows(
            torch._int_mm(xq, self.q.t()), s, self.scales, x.dtype == torch.bfloat16
        )


def reference(x, q, scales, inv_smooth) -> torch.Tensor:
    """The arithmetic in torch ops (the C++ kernels do the same operations in one pass each:
    in torch, the elementwise passes over a prefill's rows cost about twice the int8 GEMM)."""
    xf = x.float() * inv_smooth
    s = (xf.abs().amax(1, keepdim=True) / 127).clamp_(min=1e-12)
    xq = xf.div_(s).round_().to(torch.int8)
    y = torch._int_mm(xq, q.t()).float()
    return y.mul_(s).mul_(scales).to(x.dtype)


def _kernels():
    """The quantize/dequantize kernels of the fused step's C++ extension (csrc/decode.cpp),
    built by `make install`; None where it cannot load (then the torch ops above)."""
    from pdserve.model.extension import extension_or_none

    return extension_or_none()


def supported() -> bool:
    """Whether this torch runs int8 GEMMs on the CPU (`torch._int_mm`)."""
    try:
        torch._int_mm(torch.ones(32, 32, dtype=torch.int8), torch.ones(32, 32, dtype=torch.int8))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@contextlib.contextmanager
def recording(linears):
    """While open, every one of `linears` (quant._Quantized) runs its dense weight and keeps
    the largest |x| per input channel it has seen (`calib_amax`)."""
    for lin in linears:
        lin.calib_amax = torch.zeros(lin.shape[1])
    try:
        yield
    finally:
        for lin in linears:
            lin.calib_amax = None


def calibration_ids(model_path: Path | None, vocab_size: int) -> list[int]:
    """The calibration text as the model's tokens; as its bytes where the model has no
    tokenizer (weights built in memory, a folder without tokenizer files: tests)."""
    text = CALIBRATION.read_text()
    if model_path is not None:
        from pdserve.model.loader import load_tokenizer

        try:
            return load_tokenizer(str(model_path)).encode(text)
        except (OSError, ValueError) as exc:
            log.warning("int8 activations calibrated on the text's bytes: %s", exc)
    return [b % vocab_size for b in text.encode()]


def calibrate(runner, token_ids: list[int], linears) -> dict:
    """Run `token_ids` through `runner`'s model (one prefill over free KV blocks, none of them
    registered anywhere, all overwritten later) and return each linear's input amax."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import ScheduledBatch
    from pdserve.engine.sequence import Sequence

    bs = runner.block_size
    ids = token_ids[: min(len(token_ids), runner.num_blocks * bs, runner.max_model_len)]
    seq = Sequence("calibration", ids, SamplingParams(max_tokens=1))
    seq.block_table = list(range(-(-len(ids) // bs)))
    with recording(linears), torch.inference_mode():
        inp, pos, meta, *_ = runner._prepare(ScheduledBatch([seq], [len(ids)]))
        runner.model.logits(runner.model(inp, pos, runner.kv_caches, meta))
        return {lin: lin.calib_amax.clone() for lin in linears}


def apply(runner, tokenizer_ids: list[int], rows) -> int:
    """Calibrate and give every quantized linear of `runner.model` its W8A8 kernel and the rows
    it runs (`rows`: kernel_rows.KernelRows); returns how many linears use it."""
    from pdserve.model import quant

    linears = quant.quantized_linears(runner.model, head=False)
    start = time.perf_counter()
    amax = calibrate(runner, tokenizer_ids, linears)
    used = 0
    for lin in linears:
        if not bool((amax[lin] > 0).all()):  # an expert no calibration token reached
            continue
        lin.a8 = Int8Activations(lin.weight, amax[lin])
    calibrated = time.perf_counter() - start
    for lin in linears:
        if lin.a8 is not None and rows is not None:
            lin.a8_rows = rows.a8_rows(lin.format, lin)
        used += lin.a8 is not None and lin.a8_rows[1] > 0
    if rows is not None:
        rows.save()
    log.info(
        "int8 activations: %d of %d linears (calibrated on %d tokens in %.1f s)",
        used, len(linears), len(tokenizer_ids), calibrated,
    )  # fmt: skip
    return used
