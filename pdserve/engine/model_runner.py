"""Owns the model and the KV cache; turns a scheduled batch into tensors and logits."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import msgspec
import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.kv_memory import zeroed_caches
from pdserve.engine.pp.pipe import Hop
from pdserve.engine.pp.stages import stage_weights
from pdserve.engine.sampler import token_logprobs
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.tp.codec import Step
from pdserve.model import act_quant, kv_int8, quant
from pdserve.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from pdserve.model.fused import FusedDecode
from pdserve.model.llama import LlamaModel
from pdserve.model.loader import ModelFiles, load_int4_blocks

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but no CUDA GPU is visible; use --device cpu")
    return dev


def cpu_has_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else float32."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda" or cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


class ModelRunner:
    """`tp`: this process's rank of a tensor-parallel engine (`engine/tp/`); rank 0 runs
    every step and sends its inputs to the other ranks, which run `forward` alike.
    `pp`: this process's stage of a pipeline-parallel engine (`engine/pp/`); stage 0 runs
    every step through its layers and sends it down the pipeline, where each later stage runs
    `run_stage`."""

    def __init__(
        self, config: EngineConfig, files: ModelFiles, max_model_len: int, tp=None, pp=None
    ):
        self.config = config
        self.model_config: ModelConfig = files.config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.pp = pp if pp is not None and pp.size > 1 else None
        weights, held = files.weights, None
        if self.pp is not None:  # this stage's layers only
            held = self.pp.held
            weights = stage_weights(weights, held, first=self.pp.stage == 0)
        self.model = LlamaModel(files.config, weights, self.dtype, self.device, self.tp, held)
        # this rank's: K and V per KV head, or MLA's latent (one "head", whole on every rank)
        self.kv_shape = files.config.kv_shape(self.model.n_kv)
        self.weights = self._quantize(files)
        # what a cache tensor holds: values in the model's dtype, or int8 rows (`kv_int8`)
        self.cache_dtype, self.cache_dim = self._cache_format()
        self.num_blocks = self._num_blocks()
        mc, kv = self.model_config, self.kv_shape
        shape = (self.num_blocks, self.block_size, kv.heads, self.cache_dim)
        # Per layer, (num_blocks, block_size, heads, dim): one layer's block is one contiguous
        # span. k_caches holds K, or MLA's latent (then v_caches is empty).
        if self.tp is not None:  # rank 0 also reaches the other ranks' caches (KV transfer)
            self.rank_caches = self.tp.caches(
                shape, self.cache_dtype, mc.num_layers, kv.tensors, held
            )
            self.k_caches, self.v_caches = self.rank_caches[0]
        elif self.pp is not None:  # stage 0 also reaches the later stages' layers
            self.k_caches, self.v_caches = self.pp.caches(
                shape, self.cache_dtype, mc.num_layers, kv.tensors
            )
            self.rank_caches = [(self.k_caches, self.v_caches)]
        else:
            per_layer = mc.num_layers * kv.tensors
            if self.device.type == "cpu":  # zeros that cost nothing until written
                caches = zeroed_caches(shape, self.cache_dtype, per_layer)
            else:
                caches = [torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
                          for _ in range(per_layer)]  # fmt: skip
            self.k_caches = caches[: mc.num_layers]
            self.v_caches = caches[mc.num_layers :]
            self.rank_caches = [(self.k_caches, self.v_caches)]
        # what each layer's attention gets: (k_cache, v_cache), or (latent_cache,)
        self.kv_caches = (
            [(k,) for k in self.k_caches]
            if kv.is_latent
            else list(zip(self.k_caches, self.v_caches, strict=True))
        )
        if self._wants_int8_activations():  # the many-row steps' kernel: model/act_quant.py
            ids = act_quant.calibration_ids(files.path, self.model_config.vocab_size)
            used = act_quant.apply(self, ids, self.kernel_rows)
            self.activations = f"int8 for big steps ({used} linears)" if used else "dense"
        else:
            self.activations = "dense"
        eager = self._eager_reason()  # None: the fused step, its extension built or loaded
        self._choose_prompt_kernels()  # after that load: the extension's kernel is timed too
        # decode_path says which decode step runs, and why (the worker's ready line); the fused
        # step's linears take the row parts just chosen
        self.fused, self.decode_path = self._fused_decode(eager)
        self.fused_prompt_rows = self._fused_prompt_rows()

    def _choose_prompt_kernels(self) -> None:
        """Where a prompt's work runs on this machine, as measured here once (bf16 on CPU;
        cached with the quantized kernels' rows, `kernel_rows.KernelRows`): each layer's chunk
        size from which its attention runs pdserve's own kernel rather than torch's SDPA, and
        each packed linear's row counts at which its GEMM runs as row parts."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16:
            return
        from pdserve.model.kernel_rows import KernelRows

        rows = self.kernel_rows or KernelRows(self.dtype)
        attns = [layer.attn for layer in self.model.layers if hasattr(layer.attn, "kernel_queries")]
        if attns:
            heads = (self.model.n_heads, self.model.n_kv, self.kv_shape.dim)
            queries = rows.prompt_kernel_queries(*heads)
            for attn in attns:
                attn.kernel_queries = queries
        quant.set_split_rows(self.model, rows)  # saves the table

    def _fused_prompt_rows(self) -> int:
        """The most rows of a step of prompt chunks alone that the fused step computes (0:
        none). The eager model gives a prompt's rows the dense weight and keeps them bf16
        (quant.prompt_rows); the fused step takes them where that changes nothing but the
        rounding. On a CPU with AMX, where every layer's linears hold the file's own 4-bit
        blocks (the dense weight's values but for their scales' rounding to bf16; not weights
        quantized at load), it runs them on AMX tiles up to their measured `max_rows` (bf16
        rows times the blocks unpacked to bf16; SmolLM2's first-token logits as close to
        float32's as the eager prefill's, tests/model/test_real_model.py) and the dense weight
        beyond, in row parts where the eager model's would be (`Dense.split_rows`). Without AMX
        every prompt row takes what the eager model gives it (int8 activations where the model
        has them, the dense weight beyond: csrc/decode.cpp `Linear`, `exact`), whatever the
        weights. A prompt's run of rows attends by the prompt attention kernel (csrc/decode.cpp
        `attend_run`) on a bf16 cache without a sliding window; elsewhere its rows go one by
        one through the decode attention, whose reads grow with the square of the rows, so only
        up to `max_rows`. The step skips the eager model's per-layer Python, and on AMX below
        `max_rows` the dense weights' bytes: SmolLM2 Q4_1, 2 threads, a lone prompt to its
        first token, 32 / 64 / 128 / 256 / 512 / 1,024 tokens on a Xeon with AMX 46 / 46 / 58 /
        91 / 149 / 293 ms eager, 14 / 22 / 44 / 77 / 134 / 287 fused; 32 / 128 / 256 tokens on
        a Zen 4 (no AMX) 36 / 90 / 185 ms eager, 26 / 86 / 161 fused; 4 x 256 alike."""
        if self.fused is None or self.dtype != torch.bfloat16:
            return 0
        from pdserve.model.extension import load_extension

        linears = [
            lin
            for layer in self.model.layers
            for lin in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)
        ]
        amx = load_extension().amx_available()
        if amx and not all(getattr(lin, "kind", 0) == 3 and lin.stored for lin in linears):
            return 0  # dense, quantized here, or not the few-row kernel: the eager model
        if self.fused.prompt_runs:
            return self.config.max_num_batched_tokens
        return min(getattr(lin, "max_rows", 0) for lin in linears)

    def _eager_reason(self) -> str | None:
        """Why the decode step stays eager (the worker's ready line says it): --enforce-eager,
        not on CPU, a model the fused step does not take, or no compiler; None: the fused
        step, its C++ extension built (or loaded) here."""
        if self.config.enforce_eager:
            return "eager (--enforce-eager)"
        if self.pp is not None:
            return f"eager (pipeline parallel, {self.pp.size} stages)"
        if self.tp is not None:
            ep = self.config.expert_parallel_size
            experts = f", experts over {ep} groups" if ep > 1 else ""
            return f"eager (tensor parallel, {self.tp.size} ranks{experts})"
        if self.device.type != "cpu":
            return "eager"
        mc = self.model_config
        if (why := self.model.family.eager_reason(mc, self.model.layers)) is not None:
            return f"eager ({mc.architecture}: {why})"
        shapes = (
            mc.head_dim in (16, 32, 64, 128) and not (mc.hidden_size | mc.intermediate_size) % 16
        )
        if self.dtype not in (torch.float32, torch.bfloat16) or not shapes:
            return (
                "eager (the fused step takes float32/bfloat16, head_dim 16, 32, 64 or 128, "
                "hidden and intermediate sizes multiples of 16)"
            )
        from pdserve.model.extension import load_extension

        try:
            load_extension()
        except Exception as exc:  # no compiler, or it failed: serve eagerly, and say why
            log.warning(
                "the fused decode step could not be built, decoding eagerly (slower): "
                "%s; install gcc/g++ and ninja, or pass --enforce-eager",
                exc,
            )
            return "eager (the fused step failed to build: see the log)"
        return None

    def _fused_decode(self, eager: str | None) -> tuple[FusedDecode | None, str]:
        """The compiled decode step and how it loaded, unless `eager` says why not."""
        if eager is not None:
            return None, eager
        fused = FusedDecode(self.model, self.kv_caches)
        return fused, f"fused ({fused.load_note})"

    def _quantize(self, files: ModelFiles) -> str:
        """Apply `config.weights` to the model; returns the format chosen (auto resolved)."""
        fmt = self.config.weights
        # every linear's input size as this rank holds it (MLA's q_lora_rank, a TP slice, ...)
        in_features = math.gcd(*(lin.shape[1] for lin in self.model.linears()))
        quant.check_format(fmt, self.device, in_features)
        # a tensor-parallel rank holds slices: the file's whole-weight blocks do not apply
        wants_blocks = (
            fmt in ("auto", "int4") and self.device.type == "cpu" and not self.tp and not self.pp
        )
        blocks = load_int4_blocks(files) if wants_blocks else {}
        fmt = quant.resolve_format(fmt, self.device, blocks, self.dtype)
        if fmt == "int8" and in_features % quant.INT8_MULTIPLE:  # auto: the kernel cannot run
            fmt = "bf16"
        if fmt != "bf16" and self.dtype == torch.float32:
            log.warning(
                "--weights %s with --dtype float32: torch's %s kernel is 3-50x slower in "
                "float32 than in bfloat16 (use --dtype bfloat16, or --weights auto)",
                fmt,
                fmt,
            )
        rows = None
        if fmt != "bf16" and self.device.type == "cpu":  # where each kernel wins, here
            from pdserve.model.kernel_rows import KernelRows

            rows = KernelRows(self.dtype)
        self.kernel_rows = rows
        quant.quantize_model(self.model, fmt, blocks, rows)
        log.info("weights: %s", fmt)
        return fmt

    def _wants_int8_activations(self) -> bool:
        """`--int8-activations on`: for quantized weights on CPU, one engine process (a
        tensor-parallel rank holds slices, calibrated nowhere), where torch has int8 GEMMs."""
        if self.config.int8_activations == "on" and (self.weights == "bf16" or self.tp or self.pp):
            log.warning("--int8-activations on applies to int8/int4 weights on one CPU process "
                        "(not bf16 weights, not tensor-parallel ranks): not used")  # fmt: skip
        return (
            self.config.int8_activations == "on"
            and self.weights != "bf16"
            and self.device.type == "cpu"
            and self.tp is None
            and self.pp is None
            and act_quant.supported()
        )

    def _cache_format(self) -> tuple[torch.dtype, int]:
        """(dtype, last dimension) of the cache tensors: --kv-cache-dtype auto keeps K and V in
        the model's dtype; int8 keeps each head's row as int8 values and their scale."""
        kv = self.kv_shape
        if self.config.kv_cache_dtype == "auto":
            return self.dtype, kv.dim
        if kv.is_latent:
            raise ValueError(
                "--kv-cache-dtype int8 quantizes K and V per KV head; this model caches one "
                "multi-head latent (MLA), kept in --dtype: use --kv-cache-dtype auto"
            )
        if self.device.type != "cpu":
            raise ValueError(
                f"--kv-cache-dtype int8 runs on CPU only (this engine is on {self.device}): use "
                "--kv-cache-dtype auto"
            )
        return torch.int8, kv_int8.row_width(kv.dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V (or the MLA latent)."""
        elem = torch.tensor([], dtype=self.cache_dtype).element_size()
        kv = self.kv_shape
        per_token = self.model_config.num_layers * kv.tensors * kv.heads * self.cache_dim * elem
        return self.block_size * per_token

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.kv_cache_gb is not None:
            budget = cfg.kv_cache_gb * (1 << 30)
        elif self.device.type == "cuda":
            budget = gpu_kv_budget(*torch.cuda.mem_get_info(self.device), cfg.kv_cache_fraction)
        else:
            budget = 1 << 30  # 1 GiB on CPU: ~46k tokens of SmolLM2-135M in bf16
        return max(1, int(budget // self.block_bytes))

    def _prepare(self, batch: ScheduledBatch):
        bs, dev = self.block_size, self.device
        # Decodes first, shortest context first, so that they can be grouped by length below.
        order = sorted(
            range(len(batch.seqs)),
            key=lambda i: (batch.num_new_tokens[i] != 1, batch.seqs[i].num_computed_tokens),
        )
        ids, pos, slots, prefills, dec_tables, dec_lens, sample_rows = [], [], [], [], [], [], []
        prompt_spans = []  # (seq index, first row, first position) of prompt logprob rows
        for i in order:
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = seq.block_table
            ids.extend(seq.step_token_ids()[start:end])
            pos.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1:
                dec_tables.append(table[: -(-end // bs)])
                dec_lens.append(end)
            else:
                t = torch.tensor(table[: -(-end // bs)], dtype=torch.long, device=dev)
                prompt = start < seq.num_prompt_tokens
                prefills.append(PrefillSpan(len(ids) - n, len(ids), end, t, start == 0, prompt))
            if seq.spec_token_ids:  # verifying proposals: every row is scored
                sample_rows.extend((i, r) for r in range(len(ids) - n, len(ids)))
            elif end == seq.num_tokens:
                sample_rows.append((i, len(ids) - 1))
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                prompt_spans.append((i, len(ids) - n, start))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(dec_lens),
            decode_groups=self._decode_groups(dec_tables, dec_lens),
            prefills=prefills,
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions, meta, sample_rows, prompt_spans

    def _decode_groups(self, tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Decodes (sorted by length) in groups whose contexts are within 2x of each other:
        each group is padded only to its own longest context, so one long document does not
        make every short chat gather thousands of padded keys."""
        groups, start, bs, dev = [], 0, self.block_size, self.device
        window = self.model_config.sliding_window
        for i in range(1, len(tables) + 1):
            if i < len(tables) and len(tables[i]) <= max(8, 2 * len(tables[start])):
                continue
            width = len(tables[i - 1])
            padded = [t + [0] * (width - len(t)) for t in tables[start:i]]
            glens = torch.tensor(lens[start:i], device=dev)
            key_pos = torch.arange(width * bs, device=dev)
            mask = key_pos[None, :] < glens[:, None]
            if window is not None:  # sliding-window attention: the last `window` positions
                mask &= key_pos[None, :] >= glens[:, None] - window
            mask = mask[:, None, None, :]  # (b, 1, 1, L)
            table = torch.tensor(padded, dtype=torch.long, device=dev)
            groups.append(DecodeGroup(start, i, table, mask))
            start = i
        return groups

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, layer_hook=None, before_layer=None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Runs one step. Returns (indices into batch.seqs that get a token, their logits).
        A sequence verifying proposals gets its 1 + k rows, its index repeated.
        `before_layer(i)` / `layer_hook(i)` run before / after layer i (KV loads / streaming)."""
        if self.fused is not None and layer_hook is None and before_layer is None:
            fusable = [self._fusable(s, n) for s, n in zip(*batch, strict=True)]
            if all(fusable):
                return self._run_fused(batch)
            if any(fusable):  # a mixed step: its decodes and its prompt chunks apart
                return self._run_split(batch, fusable)
            return self._run_chunks(batch)
        return self._run_eager(batch, layer_hook, before_layer)

    def _run_chunks(self, batch: ScheduledBatch):
        """Prompt chunks without decodes: the fused step where it takes them
        (`_prompts_alone`), else the eager model; as `run`."""
        if self._prompts_alone(batch):
            return self._run_fused(batch, prompt=True)
        return self._run_eager(batch)

    @staticmethod
    def _fusable(seq, n: int) -> bool:
        """Whether the fused step can compute seq's n tokens this step: one token (or one plus
        its proposals), and no prompt logprobs still to give."""
        prompt_logprobs = seq.params.prompt_logprobs is not None
        return (n == 1 or bool(seq.spec_token_ids)) and not (
            prompt_logprobs and seq.num_computed_tokens < seq.num_prompt_tokens
        )

    def _prompts_alone(self, batch: ScheduledBatch) -> bool:
        """Whether the step is prompt chunks alone (no decodes, no proposals, no prompt
        logprobs) of at most `fused_prompt_rows` rows in all: the fused step computes them.
        (Beside decodes they are a call of their own, `_run_split`: the decodes' rows keep a
        plain step's bits.)"""
        if sum(batch.num_new_tokens) > self.fused_prompt_rows:
            return False
        return all(
            n > 1
            and not seq.spec_token_ids
            and seq.num_computed_tokens < seq.num_prompt_tokens
            and seq.params.prompt_logprobs is None
            for seq, n in zip(*batch, strict=True)
        )

    def _run_split(self, batch: ScheduledBatch, fusable: list[bool]):
        """A step mixing decodes with prefill chunks as two calls, the decodes through the fused
        step and the chunks as `_run_chunks` takes them; as `run`. The eager model's decode
        attention gathers and pads every context (at 47 decodes beside a 934-token chunk, the
        step took 1,071 ms, against 812 ms for a chunk alone and ~2 ms a row fused)."""
        parts = [
            [i for i, f in enumerate(fusable) if f],
            [i for i, f in enumerate(fusable) if not f],
        ]
        indices, logits = [], []
        for part, run in zip(parts, (self._run_fused, self._run_chunks), strict=True):
            sub = ScheduledBatch(
                [batch.seqs[i] for i in part], [batch.num_new_tokens[i] for i in part]
            )
            got, rows = run(sub)
            indices += [part[i] for i in got]
            if rows is not None:
                logits.append(rows)
        return indices, torch.cat(logits) if logits else None

    def _run_eager(self, batch: ScheduledBatch, layer_hook=None, before_layer=None):
        input_ids, positions, meta, sample_rows, prompt_spans = self._prepare(batch)
        if self.tp is not None:  # the other ranks run this step with us
            self.tp.send_step(input_ids, positions, meta)
        meta.layer_hook, meta.before_layer = layer_hook, before_layer
        if self.pp is not None:
            wait = bool(sample_rows or prompt_spans)
            hidden = self._run_pipeline(input_ids, positions, meta, wait)
            if hidden is None:  # nothing sampled: the later stages compute it meanwhile
                return [], None
        else:
            hidden = self.forward(input_ids, positions, meta)
        for i, row, start in prompt_spans:
            self._prompt_logprobs(batch.seqs[i], hidden, row, start, batch.num_new_tokens[i])
        if not sample_rows:
            return [], None
        rows = torch.tensor([r for _, r in sample_rows], device=self.device)
        return [i for i, _ in sample_rows], self.model.logits(hidden[rows]).cpu()

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """The model over one step's inputs (a tensor-parallel rank's whole step)."""
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _run_pipeline(self, input_ids, positions, meta: AttentionMetadata, wait: bool):
        """Stage 0's part of a step: embed, its layers, then the step down the pipeline. With
        `wait` (the step samples) the final hidden states (T, hidden) once the last stage sends
        them back; else None at once. The later stages' layers' hooks run before the step is
        sent: what they push (`StageLink`) goes down with it, and each stage pushes its layers
        as it computes them."""
        pp, model = self.pp, self.model
        x = model.run_layers(model.embed[input_ids], positions, self.kv_caches, meta)
        later = range(pp.held.stop, self.model_config.num_layers)
        try:
            for hook in (meta.before_layer, meta.layer_hook):  # loads land before layers run
                if hook is not None:
                    for i in later:
                        hook(i)
        finally:  # (a hook that failed fails the step: its pushes go with no later step)
            pushes = pp.take_pushes()
        step = Step(input_ids, positions, meta.slot_mapping, meta.num_decodes,
                    meta.decode_groups, meta.prefills)  # fmt: skip
        pp.send(Hop(step, x, wait, pushes), 1)
        if not wait:
            pp.unsettled += 1
            return None
        x = pp.recv(pp.size - 1, torch.Tensor)
        pp.unsettled = 0  # the stages ran every step before this one too
        return model.final_norm(x)

    @torch.inference_mode()
    def run_stage(self, hop, layer_hook=None) -> torch.Tensor:
        """A later stage's part of a step: its layers over the hidden states that came down
        (with the stage's other tensor-parallel ranks, sent them first); `layer_hook(i)` after
        each (the stage's own KV push)."""
        step = msgspec.structs.replace(hop.step, hidden=hop.hidden)
        if self.tp is not None:
            self.tp.broadcast(step)
        return self.run_layers(step, layer_hook)

    @torch.inference_mode()
    def run_layers(self, step, layer_hook=None) -> torch.Tensor:
        """This process's layers over `step.hidden` (a later pipeline stage's rank)."""
        meta = step.meta()
        meta.layer_hook = layer_hook
        return self.model.run_layers(step.hidden, step.positions, self.kv_caches, meta)

    def _prompt_logprobs(self, seq, hidden, row: int, start: int, n: int) -> None:
        """Append the logprobs of seq's prompt tokens start+1 .. (those this step's rows
        predict) to seq.prompt_logprobs, a few hundred rows of logits at a time."""
        end = min(start + n, seq.num_prompt_tokens - 1)  # positions whose next token is prompt
        del seq.prompt_logprobs[start:]  # a preempted sequence computes its prompt again
        k = seq.params.prompt_logprobs
        for a in range(start, end, 256):
            b = min(a + 256, end)
            logits = self.model.logits(hidden[row + a - start : row + b - start]).float().cpu()
            targets = torch.tensor(seq.token_ids[a + 1 : b + 1])
            seq.prompt_logprobs.extend(token_logprobs(logits, targets, [k] * (b - a)))

    def _run_fused(
        self, batch: ScheduledBatch, prompt: bool = False
    ) -> tuple[list[int], torch.Tensor | None]:
        """A step of one token per sequence through the fused step; as `run`. (A token of a
        prompt chunked one token at a time computes alike; it just samples nothing.) A
        sequence verifying k proposals is k+1 rows of one token each, at consecutive positions
        over the same blocks: the step writes every row's K/V before any row attends; so is a
        prompt's chunk (`prompt`: `_prompts_alone`), each row attending to the keys up to
        its own position, and only the rows that sample get logits."""
        bs = self.block_size
        ids, pos, slots, tables, lens, rows = [], [], [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            c, tokens = seq.num_computed_tokens, seq.step_token_ids()
            for p in range(c, c + n):
                ids.append(tokens[p])
                pos.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
                tables.append(seq.block_table)
                lens.append(p + 1)
                if seq.spec_token_ids or p + 1 == seq.num_tokens:
                    rows.append((i, len(ids) - 1))
        width = max(p // bs for p in pos) + 1
        tables = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
        keep = [r for _, r in rows]
        args = [torch.tensor(v) for v in (ids, pos, slots, tables, lens)]
        if prompt:  # logits for the rows that sample only
            logits = self.fused(*args, keep=torch.tensor(keep, dtype=torch.long), prompt=True)
            return ([i for i, _ in rows], logits) if rows else ([], None)
        logits = self.fused(*args)
        if not rows:
            return [], None
        return [i for i, _ in rows], logits if len(keep) == len(ids) else logits[keep]


def gpu_kv_budget(free: int, total: int, fraction: float) -> float:
    """Bytes of KV cache on a GPU with `free` of `total` bytes free: `fraction` of its total
    memory, at most 90 % of what is free. Of the total, not of what is free, so that workers
    sharing one GPU get alike whichever starts first (of what is free, the second of two got
    three quarters of the first's)."""
    return min(total * fraction, free * 0.9)
