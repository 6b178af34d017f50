"""Per-iteration latency of one engine instance (a tensor-parallel group): a roofline.

One forward pass over a batch of T new tokens costs

    overhead + per_seq x seqs + per_cached_token x cached tokens read + all-reduce
    + max(GEMM FLOPs / (peak x mfu x T / (T + half_tokens)), bytes / (bandwidth x mbu))
    + attention FLOPs / (peak x attn_eff)

GEMM FLOPs are the weight matmuls (2 x params per token) and the output head per sampled token;
their efficiency falls for small T (a GEMM with few rows cannot fill the device), which is what
makes tiny prefill chunks expensive. Bytes are the weights read once per pass (for MoE only the
experts the batch touches) plus the KV cache read. Prefill lands on the compute side of the max
and decode on the bandwidth side; a chunked-prefill batch falls wherever its mix puts it.
Attention (4 x layers x heads x head_dim per query-key pair) is costed on its own because
engines implement it apart from the GEMMs, at their own efficiency. All efficiencies and the
overheads are what `pdserve profile` fits on this machine.

Expert parallelism (`ep` > 1, mixture-of-experts models only) splits the routed experts whole
over `ep` ranks of one node, the wide-EP layout of SGLang and vLLM: attention runs tensor
parallel over `tp` ranks in `ep / tp` data-parallel groups, each serving its share of the
sequences with its own KV cache, so an instance holds max(tp, ep) GPUs. Per GPU it keeps the
dense weights / tp and the experts / ep; each MoE layer dispatches every token's hidden state
to its top-k experts and combines them back (two all-to-alls over the node's link) instead of
the all-reduce. Balanced expert load is assumed (no hot experts).

Pipeline parallelism (`pp` > 1, a prefill pool's `--prefill-pp`) cuts the layers into `pp`
stages, each a TP (x EP) group holding ceil(layers / pp) consecutive layers, their weights and
their KV: the slowest (largest) stage sets the pace, so a stage's pass costs that share of the
layer work (GEMMs, attention, KV reads and gathers, all-reduces) plus the per-pass overheads.
A prompt in m micro-batches (prefill chunks) flows through the stages, as the engine's pipeline
runs it: a chunk that samples nothing frees stage 0 once it has computed its layers, and the
step that samples waits for its chunk to come back through every stage, so the prompt takes
`pipeline_s`: (m + pp - 1) x stage + (pp - 1) x the activations' hop between two stages
(hidden x tokens x activation bytes over the stage link: the node's when the instance fits one
node, the network's otherwise). The output head, which runs once on stage 0, is costed in each
stage's pass of a sampling step (< 1 % of a chunk's FLOPs); the last stage's hidden states of
the sampled tokens going back to stage 0 (a few kB) are left out. Stages that share one
stage's devices (`shared_stages`: `pdserve serve` pins a pipeline's stages to the same cores
when its worker has fewer cores than stages) overlap nothing: the devices run each stage's
pass in turn, so every step costs pp x stage + (pp - 1) x hop, and they hold every stage's
weights and KV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.sim.hardware import Accelerator, Link, get_link
from pdserve.sim.kvmath import dtype_bits, kv_bytes_per_token, kv_shape_of
from pdserve.sim.models import ModelSpec

MEMORY_UTILIZATION = 0.9  # share of device memory for weights + KV, as vLLM's default


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak and fixed costs; defaults are typical of tuned GPU engines."""

    mfu: float = 0.6  # large GEMMs reach ~60 % of dense BF16 peak
    mbu: float = 0.75  # decode GEMVs reach ~70-80 % of HBM bandwidth
    iteration_overhead_s: float = 0.002  # scheduling, launches, sampling per forward pass
    per_seq_overhead_s: float = 0.0
    attn_eff: float = 0.5  # FlashAttention-class kernels: ~50 % of peak
    half_tokens: float = 128.0  # GEMM rows at which efficiency is half of `mfu`
    # Seconds per cached token a pass reads beyond the bandwidth roof: an engine whose decode
    # attention gathers paged KV slowly (pdserve's on a CPU); 0 for fused GPU kernels.
    per_cached_token_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("mfu", "mbu", "attn_eff"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {getattr(self, name)}")
        if min(self.iteration_overhead_s, self.per_seq_overhead_s, self.per_cached_token_s) < 0:
            raise ValueError("overheads must be >= 0 seconds")
        if self.half_tokens < 0:
            raise ValueError(f"half_tokens must be >= 0, got {self.half_tokens}")


class Batch(NamedTuple):
    """What one forward pass computes, in aggregate.

    tokens: new tokens (prefill + one per decoding sequence); sampled: sequences that sample a
    token; attn_pairs: causal query-key pairs; kv_read: cached tokens read; seqs: sequences.
    """

    tokens: int
    sampled: int
    attn_pairs: float
    kv_read: float
    seqs: int


class Work(NamedTuple):
    """Raw work of one pass: GEMM FLOPs and attention FLOPs (whole TP group), bytes per GPU."""

    gemm_flops: float
    attn_flops: float
    bytes: float


class DecodeCoeffs(NamedTuple):
    """Step i of a decode stretch takes l0 + l1 i + max(c0 + c1 i, m0 + m1 i) seconds."""

    l0: float
    l1: float
    c0: float
    c1: float
    m0: float
    m1: float


class LatencyModel:
    """Iteration times for `model` on `tp` x `accel` with the given dtypes and efficiencies."""

    def __init__(
        self,
        model: ModelSpec,
        accel: Accelerator,
        tp: int = 1,
        eff: Efficiency | None = None,
        weight_dtype: str = "bf16",
        kv_dtype: str = "bf16",
        ep: int = 1,
        pp: int = 1,
        stage_link: Link | None = None,
        shared_stages: bool = False,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tensor parallelism must be >= 1, got {tp}")
        check_ep(model, tp, ep)
        check_pp(model, pp)
        self.model, self.accel, self.tp, self.ep, self.pp = model, accel, tp, ep, pp
        self.dp = ep // tp if ep > 1 else 1  # data-parallel attention groups
        self.gpus = tp * self.dp  # one stage's devices
        self.shared_stages = shared_stages and pp > 1  # every stage on those devices
        self.devices = self.gpus * (1 if self.shared_stages else pp)  # the instance's
        self.stage_layers = -(-model.num_layers // pp)  # the largest stage's
        self._share = self.stage_layers / model.num_layers  # of the layer work, per stage
        # Activations between stages: each of a stage's GPUs sends its part of the hidden states.
        self.stage_link = stage_link or get_link(accel.tp_link)
        self.eff = eff or Efficiency()
        self.weight_bytes = model.num_params * dtype_bits(weight_dtype) / 8
        self._act_bytes = 2 if dtype_bits(weight_dtype) <= 16 else 4
        kv_token = kv_bytes_per_token(model, kv_dtype)
        # KV heads are split over TP ranks; past the head count (and for MLA's single latent)
        # every rank keeps a copy. Data-parallel groups each hold their own sequences' KV.
        shards = 1 if kv_shape_of(model).is_latent else min(tp, model.num_kv_heads)
        self.kv_bytes_per_token_gpu = kv_token / shards / self.dp * self._share
        self._flops_s = accel.peak_flops * self.gpus * self.eff.mfu
        self._attn_s = accel.peak_flops * self.gpus * self.eff.attn_eff
        self._bytes_s = accel.mem_bytes_per_s * self.eff.mbu
        self._attn_flops = 4 * self.stage_layers * model.num_heads * model.head_dim
        self._hop_bytes_s = self.stage_link.instance_bytes_per_s(self.gpus)
        self._head_flops = 2 * model.vocab_size * model.hidden_size
        self._init_costs()

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV cache that fit beside the weights (0 when the weights do not fit)."""
        held = self.pp if self.shared_stages else 1  # stages whose weights and KV they hold
        free = self.accel.mem_bytes * MEMORY_UTILIZATION - held * (self._dense_w + self._expert_w)
        return max(0, int(free / (held * self.kv_bytes_per_token_gpu)))

    def weights_read(self, tokens: int) -> float:
        """Weight bytes per GPU one pass reads; MoE reads only the experts its tokens touch."""
        if not self._expert_w or not tokens:
            return self._dense_w + self._expert_w
        share = self.model.experts_per_token / self.model.num_experts
        return self._dense_w + self._expert_w * (1.0 - (1.0 - share) ** tokens)

    def allreduce_s(self, tokens: int) -> float:
        """The instance's communication per pass: two ring all-reduces of the activations per
        layer across the TP group; with EP, one (attention's) plus the MoE's dispatch and
        combine all-to-alls."""
        if self.gpus == 1 or tokens == 0:
            return 0.0
        return self._ar_fixed + self._ar_per_token * tokens

    def _init_costs(self) -> None:
        """Per-instance constants of `weights_read` and `allreduce_s` (hot in the simulator)."""
        expert = self.model.expert_params * self.weight_bytes / self.model.num_params
        self._dense_w = (self.weight_bytes - expert) / self.tp * self._share
        self._expert_w = expert / (self.ep if self.ep > 1 else self.tp) * self._share
        link = get_link(self.accel.tp_link)
        layers, per_token = self.stage_layers, self.model.hidden_size * self._act_bytes
        steps = 2 * (self.tp - 1)
        all_reduces = 2 if self.ep == 1 else 1
        # A ring all-reduce of a DP group's tokens (tokens / dp of the pass) ...
        ar_token = all_reduces * layers * steps / self.tp * per_token / self.dp
        self._ar_fixed = all_reduces * layers * steps * link.latency_s
        if self.ep > 1:  # ... and each GPU's tokens to their top-k experts' ranks and back
            share = (self.ep - 1) / self.ep
            ar_token += 2 * layers * self.model.experts_per_token * per_token * share / self.gpus
            self._ar_fixed += 2 * layers * link.latency_s
        self._ar_per_token = ar_token / link.practical_bytes_per_s

    def _fixed(self, batch: Batch) -> float:
        return (
            self.eff.iteration_overhead_s
            + self.eff.per_seq_overhead_s * batch.seqs
            + self.eff.per_cached_token_s * batch.kv_read * self._share  # its layers' gathers
            + self.allreduce_s(batch.tokens)
        )

    def work(self, batch: Batch) -> Work:
        """The raw FLOPs and bytes of one pass over `batch`."""
        gemm = 2 * self.model.layer_params_per_token * self._share * batch.tokens
        gemm += self._head_flops * batch.sampled
        kv = self.kv_bytes_per_token_gpu * (batch.kv_read + batch.tokens)
        return Work(gemm, self._attn_flops * batch.attn_pairs, self.weights_read(batch.tokens) + kv)

    def _gemm_s(self, flops: float, tokens: int) -> float:
        if tokens <= 0:
            return 0.0  # a data-parallel group's GEMMs have its share of the rows
        return flops / self._flops_s * (1 + self.eff.half_tokens * self.dp / tokens)

    def stage(self, batch: Batch) -> float:
        """Seconds one pipeline stage takes over `batch` (its layers; all of them at pp 1)."""
        w = self.work(batch)
        roof = max(self._gemm_s(w.gemm_flops, batch.tokens), w.bytes / self._bytes_s)
        return self._fixed(batch) + roof + w.attn_flops / self._attn_s

    def activation_bytes(self, tokens: int) -> float:
        """Bytes of `tokens` tokens' hidden states, what one stage passes to the next."""
        return tokens * self.model.hidden_size * self._act_bytes

    def hop_s(self, tokens: int) -> float:
        """Seconds to pass `tokens` tokens' hidden states from one stage to the next."""
        return self.stage_link.latency_s + self.activation_bytes(tokens) / self._hop_bytes_s

    def iteration(self, batch: Batch) -> float:
        """Seconds the instance is busy with one step over `batch`: one stage's pass, or, for a
        step that samples through a pipeline, its chunk's way through every stage; with shared
        stages, every stage's pass in turn for every step."""
        stage = self.stage(batch)
        if self.shared_stages:
            return self.pp * stage + (self.pp - 1) * self.hop_s(batch.tokens)
        if self.pp == 1 or not batch.sampled:
            return stage
        return pipeline_s(stage, 1, self.pp, self.hop_s(batch.tokens))

    def prefill(
        self, prompt_tokens: int, cached_tokens: int = 0, chunk: int | None = None
    ) -> float:
        """Seconds to prefill one prompt alone (for reports), in chunks of `chunk` tokens
        (None: one step), as the simulator steps it."""
        total, done, end = 0.0, cached_tokens, cached_tokens + prompt_tokens
        while done < end:
            n = min(chunk or end, end - done)
            total += self.iteration(Batch(n, int(done + n == end), n * (done + n / 2), done, 1))
            done += n
        return total

    def iteration_decode(self, seqs: int, ctx_sum: float) -> float:
        """Seconds for one decode step of `seqs` sequences holding `ctx_sum` cached tokens."""
        return stretch_time(self.decode_coeffs(seqs, ctx_sum), 1)

    def decode_coeffs(self, seqs: int, ctx_sum: float) -> DecodeCoeffs:
        """Coefficients of a pure decode stretch: `seqs` sequences, `ctx_sum` cached tokens."""
        w = self.work(Batch(seqs, seqs, 0, ctx_sum, seqs))
        per_ctx = self._attn_flops / self._attn_s + self.eff.per_cached_token_s * self._share
        kv = self.kv_bytes_per_token_gpu / self._bytes_s
        return DecodeCoeffs(
            self._fixed(Batch(seqs, seqs, 0, 0, seqs)) + per_ctx * ctx_sum,
            per_ctx * seqs,
            self._gemm_s(w.gemm_flops, seqs),
            0.0,
            w.bytes / self._bytes_s,
            kv * seqs,
        )


def check_ep(model: ModelSpec, tp: int, ep: int) -> None:
    """ValueError unless EP `ep` with TP `tp` is a layout of `model`: EP 1 (none), or a MoE
    model whose experts divide evenly over `ep` ranks, `ep` a multiple of `tp`."""
    if ep == 1:
        return
    if ep < 1:
        raise ValueError(f"expert parallelism must be >= 1, got {ep}")
    if model.num_experts == 1:
        raise ValueError(f"expert parallelism needs a mixture-of-experts model; {model.name} "
                         "is dense (use EP 1)")  # fmt: skip
    if model.num_experts % ep:
        raise ValueError(f"EP {ep} does not divide {model.name}'s {model.num_experts} experts")
    if ep % tp:
        raise ValueError(f"EP {ep} must be a multiple of TP {tp} (attention's groups)")


def pipeline_s(stage_s: float, micro_batches: int, stages: int, hop_s: float) -> float:
    """Seconds for `micro_batches` equal micro-batches to flow through `stages` pipeline stages
    of `stage_s` each, `hop_s` between two: the last enters stage 0 after m - 1 stage times and
    then crosses every stage and hop (the bubble: P - 1 stage times and hops)."""
    return (micro_batches + stages - 1) * stage_s + (stages - 1) * hop_s


def check_pp(model: ModelSpec, pp: int) -> None:
    """ValueError unless `pp` pipeline stages can each hold at least one of `model`'s layers."""
    if pp < 1:
        raise ValueError(f"--prefill-pp must be >= 1, got {pp}")
    if pp > model.num_layers:
        raise ValueError(f"--prefill-pp {pp} is more stages than {model.name}'s "
                         f"{model.num_layers} layers (each stage needs one): use at most "
                         f"{model.num_layers}")  # fmt: skip


def _linear_sum(a: float, b: float, i0: int, i1: int) -> float:
    """sum of a + b*i for i in [i0, i1)."""
    n = i1 - i0
    return n * a + b * (i0 + i1 - 1) * n / 2 if n > 0 else 0.0


def stretch_time(co: DecodeCoeffs, k: int) -> float:
    """Total seconds of the first `k` steps of a decode stretch (closed form, O(1))."""
    if k <= 0:
        return 0.0
    total = _linear_sum(co.l0, co.l1, 0, k)
    if co.c1 == co.m1:
        return total + _linear_sum(max(co.c0, co.m0), co.c1, 0, k)
    # c(i) >= m(i) on one side of the crossing x; sum each side with its own line.
    x = (co.m0 - co.c0) / (co.c1 - co.m1)
    split = min(k, max(0, math.ceil(x)))
    first, second = (
        ((co.m0, co.m1), (co.c0, co.c1)) if co.c1 > co.m1 else ((co.c0, co.c1), (co.m0, co.m1))
    )
    return total + _linear_sum(*first, 0, split) + _linear_sum(*second, split, k)


def steps_to_reach(co: DecodeCoeffs, duration: float, k_max: int) -> int:
    """The fewest steps (1..k_max) whose total time is >= `duration`, else k_max."""
    lo, hi = 1, k_max
    while lo < hi:
        mid = (lo + hi) // 2
        if stretch_time(co, mid) >= duration:
            hi = mid
        else:
            lo = mid + 1
    return lo
