"""LLMEngine: add requests, step (schedule -> run -> sample -> postprocess), abort.

Used directly by workers and wrapped by the offline `LLM`. Not thread-safe: one thread steps it.
Speculative decoding's side is `Speculator` (engine/spec_decode.py); structured outputs' is
`EngineGuides` (engine/guide_masks.py).
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from dataclasses import replace
from typing import NamedTuple

import torch

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.guide_masks import EngineGuides
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.prompt_check import check_prompt
from pdserve.engine.sampler import TokenLogprobs, sample
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import ScheduledBatch, Sequence
from pdserve.engine.spec_decode import (
    SpeculativeConfig,
    Speculator,
    parse_speculative_config,
    spec_stats,
)
from pdserve.engine.step_perf import StepLog, StepPerf, phase_counts
from pdserve.model.loader import ModelFiles, load_model_files, load_tokenizer


class StepOutput(NamedTuple):
    seq: Sequence
    new_token: int
    finished: bool
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    num_output_tokens: int = 0  # the sequence's output tokens up to this one (a step may emit
    # several tokens of one sequence: speculative decoding)


class LLMEngine:
    def __init__(self, config: EngineConfig, files: ModelFiles | None = None):
        # checked before the model loads: a bad config is refused at once
        self.spec: SpeculativeConfig | None = parse_speculative_config(config.speculative_config)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.files = files or load_model_files(config.model)
        self.model_config = self.files.config
        self.fingerprint = self.files.fingerprint
        mc = self.model_config
        self.max_model_len = min(
            config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        pp = None
        if config.pipeline_parallel_size > 1:  # start the later stages, each with its layers
            from pdserve.engine.pp.stage import start_pipeline

            pp = start_pipeline(config, self.files, self.max_model_len)
        tp = None
        if config.tensor_parallel_size > 1:  # start the other ranks and hand them the model
            from pdserve.engine.tp import start_group

            tp = start_group(*stage_part(config, self.files, pp), self.max_model_len)
        self.runner = ModelRunner(config, self.files, self.max_model_len, tp, pp)
        # The model holds its own (fused, cast) copies: drop the float32 arrays (~0.5 GiB).
        self.files = self.files._replace(weights={})
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.chunk_size,
            self.max_model_len,
            chunk_only_under_decodes=config.role == "decode",
        )
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.perf = StepPerf()
        self.step_log = StepLog.for_engine(envs.step_log_dir(), config.role)
        self._tokenizer = None
        self.eos_ids = set(mc.eos_token_ids)
        self.connector = KVConnector()  # moves no KV until a worker connects one
        self.guides = EngineGuides(self._tokenizer_file, mc.vocab_size, self.eos_ids)
        self.speculator = None  # speculative decoding (engine/spec_decode.py), not on prefill
        if self.spec is not None and config.role != "prefill":
            self.speculator = Speculator(self.spec, mc.vocab_size, self.max_model_len, self)

    def connect(self, connector: KVConnector) -> None:
        """Move KV through `connector` from now on (see KVConnector for when it is called).
        A worker connects after `warm_up`, so the warm-up request moves no KV."""
        self.connector = self.scheduler.connector = self.block_manager.connector = connector

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(str(self.files.path))
        return self._tokenizer

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def make_sequence(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        replayed: int = 0,
    ) -> Sequence:
        """`replayed`: the prompt ends with this many output tokens (a migrated request)."""
        token_ids = self.encode(prompt)
        check_prompt(token_ids, params, self.max_model_len, self.model_config.vocab_size,
                     self.block_manager.num_blocks, self.config.block_size)  # fmt: skip
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, token_ids, params, num_replayed=replayed)
        if params.guide is not None:  # advanced over the output tokens replayed in the prompt
            seq.guide = self.guides.guide(params.guide, seq.generated_token_ids)
        return seq

    def _tokenizer_file(self) -> str:
        """For structured outputs (engine/guide_masks.py), on the first guided request."""
        if self.files.path is None:
            raise ValueError("structured outputs need the model's tokenizer; this has none")
        return self.tokenizer.path

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        replayed: int = 0,
    ) -> Sequence:
        seq = self.make_sequence(prompt, params, request_id, replayed)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def add_transferring(self, seq: Sequence) -> bool:
        """Decode role: hold blocks for seq's prompt, whose KV will be pushed by a prefill
        worker. False if blocks are short right now (retry later)."""
        if not self.scheduler.add_transferring(seq):
            return False
        self.requests[seq.request_id] = seq
        return True

    def start_decoding(self, request_id: str, first_token: int) -> StepOutput | None:
        """Decode role: the prompt's KV has landed; join the batch with the first token that
        the prefill worker sampled."""
        seq = self.scheduler.finish_transfer(request_id)
        return None if seq is None else self._append(seq, first_token)

    def resume_local(self, request_id: str) -> bool:
        """Decode role: the KV transfer failed or expired; prefill the prompt here instead."""
        return self.scheduler.resume_local(request_id) is not None

    def abort(self, request_id: str) -> bool:
        self.scheduler.release_held(request_id)
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        return True

    def release(self, request_id: str) -> None:
        """The connector has sent the KV of a finished request it held: free its blocks."""
        self.scheduler.release_held(request_id)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine, or the later stages of a
        pipeline-parallel one (they also stop when this process dies)."""
        if self.runner.tp is not None:
            self.runner.tp.close()
        if self.runner.pp is not None:
            self.runner.pp.close()

    def check_stages(self) -> None:
        """StageLost (`engine/pp/pipe.py`) if a stage of this pipeline-parallel engine is
        gone: it cannot step again. A no-op for any other engine."""
        if self.runner.pp is not None:
            self.runner.pp.check()

    def warm_up(self, prompt_tokens: int = 128, decode_steps: int = 3) -> None:
        """Run one throwaway request before serving: the first steps pay one-off costs
        (allocations, kernel selection), and the speed estimates that admission control reads
        (`self.perf`) exist before the first real request. Leaves no blocks and no KV events."""
        n = max(1, min(prompt_tokens, self.max_model_len - decode_steps - 1))
        ids = [(i * 7919) % self.model_config.vocab_size for i in range(n)]
        params = SamplingParams(max_tokens=decode_steps, ignore_eos=True)
        seq = self.add_request(ids, params, request_id="__warm_up__")
        while self.has_work():
            self.step()
        self.release(seq.request_id)  # in case a connector held its blocks
        self.block_manager.drain_events()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        """One iteration: schedule, run the model (the connector's layer hooks around each
        layer), sample, and finish what is done."""
        start = time.perf_counter()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        computed = [s.num_computed_tokens for s in batch.seqs] if self.step_log else []
        prefill_tokens, decode_seqs = phase_counts(batch)
        masks = self.guides.start_masks(batch.seqs, batch.num_new_tokens)
        try:
            indices, logits = self.runner.run(batch, *self._layer_hooks(batch))
        finally:  # never return (or raise) while a load may still write into blocks
            void = self.connector.step_finished(batch)
            bitmask, verify_rows = masks.result() if masks is not None else (None, {})
        self.scheduler.after_step(batch, void)
        outs = self._sample(batch, indices, logits, bitmask, verify_rows, void)
        for seq in batch.seqs:
            if seq.spec_token_ids:
                self.scheduler.rollback(seq)
        end = time.perf_counter()
        self.perf.observe(prefill_tokens, decode_seqs, start, end)
        if self.step_log:
            self.step_log.write(start, end - start, batch.num_new_tokens, computed,
                                prefill_tokens, len(outs))  # fmt: skip
        return outs

    def _layer_hooks(self, batch: ScheduledBatch):
        """(after each layer, before each layer): the connector's, when it wants them (with
        neither, a decode step may take the fused path)."""
        after = before = None
        if self.connector.wants_layers(batch):
            after = functools.partial(self.connector.after_layer, batch)
        if self.connector.loads_layers(batch):
            before = functools.partial(self.connector.wait_for_layer_load, batch)
        return after, before

    def _sample(
        self, batch, indices, logits, bitmask, verify_rows: dict[int, int], void: frozenset[int]
    ) -> list[StepOutput]:
        """A token for each sequence whose whole context is computed (none for a void step).
        `bitmask`, `verify_rows`: the guided sequences' masks (`EngineGuides.start_masks`)."""
        if void and indices:
            keep = [j for j, i in enumerate(indices) if id(batch.seqs[i]) not in void]
            indices, logits = [indices[j] for j in keep], logits[keep]
        if not indices:
            return []
        plain, spec = [], {}  # rows sampled as usual; rows of each sequence verifying proposals
        for j, i in enumerate(indices):
            (spec.setdefault(i, []) if batch.seqs[i].spec_token_ids else plain).append(j)
        outs = []
        if plain:
            idx = [indices[j] for j in plain]
            seqs = [batch.seqs[i] for i in idx]
            mask = bitmask[idx] if bitmask is not None else None
            tokens, logprobs = sample(logits[plain] if spec else logits, seqs, mask)
            outs = [self._append(s, t, lp) for s, t, lp in zip(seqs, tokens, logprobs, strict=True)]
        for i, rows in spec.items():
            start = verify_rows.get(i)
            mask = bitmask[start : start + len(rows)] if start is not None else None
            outs.extend(self._verify(batch.seqs[i], logits[rows], mask))
        return outs

    def _verify(self, seq: Sequence, logits: torch.Tensor, mask=None) -> list[StepOutput]:
        """The tokens seq keeps of its proposals' verification step (`Speculator.accept`;
        `mask`: its grammar's, a row per position), appended one by one so that a stop ends
        it where it comes."""
        outs = []
        for tok, lp in self.speculator.accept(seq, logits, mask):
            outs.append(self._append(seq, tok, lp))
            if outs[-1].finished:
                break
        return outs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_ids or token in p.stop_token_ids:
            return "stop"
        if seq.guide is not None and self.guides.finishes(seq, token):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _append(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None = None
    ) -> StepOutput:
        seq.token_ids.append(token)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            # e.g. a prefill worker keeps the blocks until their KV is on the decode worker
            keep = self.connector.request_finished(seq)
            self.scheduler.finish(seq, reason, keep_blocks=keep)
            self.requests.pop(seq.request_id, None)
        return StepOutput(seq, token, reason is not None, logprobs, seq.num_output_tokens)

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.scheduler.live)

    def stats(self) -> dict:
        s, bm = self.scheduler, self.block_manager
        return {
            "waiting": len(s.waiting),
            "queued_tokens": s.queued_prompt_tokens(),
            "transferring": len(s.transferring),
            "running": len(s.running),
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks,
            "prefix_hit_tokens": bm.hits,
            "prefix_query_tokens": bm.queries,
            "preemptions": s.num_preemptions,
            "prefill_tok_s": self.perf.prefill_tok_s,
            "decode_step_s": self.perf.decode_step_s,
            **spec_stats(self.speculator),
            "pid": os.getpid(),
        }


def stage_part(config: EngineConfig, files, pp):
    """(config, files) a tensor-parallel group starts its ranks from: the whole model, or in a
    pipeline's stage 0 (a stage of several ranks) its layers, on the threads of its share of
    the cores (`start_pipeline` pinned it to them)."""
    if pp is None:
        return config, files
    from pdserve.engine.pp.stages import stage_weights

    part = files._replace(weights=stage_weights(files.weights, pp.held, first=True))
    return replace(config, num_threads=torch.get_num_threads()), part
