"""LLMEngine: add requests, step (schedule -> run -> sample -> postprocess), abort.

Used directly by workers and wrapped by the offline `LLM`. Not thread-safe: one thread steps it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from pdserve import envs
from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.guided import GuideCompiler, GuideError
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.prompt_check import check_prompt
from pdserve.engine.sampler import TokenLogprobs, sample, token_logprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import ScheduledBatch, Sequence
from pdserve.engine.spec_decode import (
    SpeculativeConfig,
    make_proposer,
    parse_speculative_config,
    speculates,
    verify,
)
from pdserve.engine.step_perf import StepLog, StepPerf
from pdserve.model.loader import ModelFiles, load_model_files, load_tokenizer

log = logging.getLogger(__name__)


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
        tp = None
        if config.tensor_parallel_size > 1:  # start the other ranks and hand them the model
            from pdserve.engine.tp import start_group

            tp = start_group(config, self.files, self.max_model_len)
        self.runner = ModelRunner(config, self.files, self.max_model_len, tp)
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
        self._guides: GuideCompiler | None = None
        self._masker: ThreadPoolExecutor | None = None  # fills guides' masks beside the model
        self.proposer = None  # speculative decoding (engine/spec_decode.py), not on prefill
        if self.spec is not None and config.role != "prefill":
            self.proposer = make_proposer(self.spec, mc.vocab_size)
        self.spec_proposed = self.spec_accepted = self.spec_verifies = 0

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

    @property
    def guides(self) -> GuideCompiler:
        """Builds the guides of structured outputs (made on first use: ~0.2 s)."""
        if self._guides is None:
            if self.files.path is None:
                raise ValueError("structured outputs need the model's tokenizer; this has none")
            self._guides = GuideCompiler(
                self.tokenizer.path, self.model_config.vocab_size, sorted(self.eos_ids)
            )
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="guide-mask")
        return self._guides

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
        """Stop the other ranks of a tensor-parallel engine (they also stop when this process
        dies)."""
        if self.runner.tp is not None:
            self.runner.tp.close()

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
        self._propose()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        computed = [s.num_computed_tokens for s in batch.seqs] if self.step_log else []
        prefill_tokens, decode_seqs = _phase_counts(batch)
        masks = self._start_masks(batch)
        try:
            indices, logits = self.runner.run(batch, *self._layer_hooks(batch))
        finally:  # never return (or raise) while a load may still write into blocks
            void = self.connector.step_finished(batch)
            bitmask = masks.result() if masks is not None else None
        self.scheduler.after_step(batch, void)
        outs = self._sample(batch, indices, logits, bitmask, void)
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

    def _sample(self, batch, indices, logits, bitmask, void: frozenset[int]) -> list[StepOutput]:
        """A token for each sequence whose whole context is computed (none for a void step)."""
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
            outs.extend(self._verify(batch.seqs[i], logits[rows]))
        return outs

    def _propose(self) -> None:
        """Proposals for the decoding sequences that speculate, unless the batch is above
        `disable_by_batch_size` (then speculation costs more than it gains)."""
        if self.proposer is None:
            return
        decoding = []
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            if seq.num_uncomputed_tokens == 1 and seq.num_output_tokens > 0:
                decoding.append(seq)
        if len(decoding) > self.spec.disable_by_batch_size:
            return
        for seq in decoding:
            k = min(self.spec.num_speculative_tokens,
                    seq.params.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1)  # fmt: skip
            if k >= 1 and speculates(seq):
                seq.spec_token_ids = self.proposer.propose(seq, k)

    def _verify(self, seq: Sequence, logits: torch.Tensor) -> list[StepOutput]:
        """The tokens seq keeps of its proposals' verification step (spec_decode.verify),
        appended one by one so that a stop ends it where it comes."""
        draft = seq.spec_token_ids
        tokens = verify(logits, seq, draft)
        self.spec_verifies += 1
        self.spec_proposed += len(draft)
        self.spec_accepted += len(tokens) - 1
        lps: list = [None] * len(tokens)
        if seq.params.logprobs is not None:
            k = [seq.params.logprobs] * len(tokens)
            lps = token_logprobs(logits[: len(tokens)], torch.tensor(tokens), k)
        outs = []
        for tok, lp in zip(tokens, lps, strict=True):
            outs.append(self._append(seq, tok, lp))
            if outs[-1].finished:
                break
        return outs

    def _start_masks(self, batch) -> Future | None:
        """Guided sequences that sample this step: their next-token masks, computed on a
        thread while the model runs (llguidance releases the GIL). A (len(batch), words)
        bitmask; rows of unguided sequences allow everything."""
        if not any(s.guide is not None for s in batch.seqs):
            return None
        guides = [
            s.guide if s.num_computed_tokens + n == s.num_tokens else None
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        ]
        bitmask = self.guides.allocate_bitmask(len(guides))

        def fill():
            self.guides.fill_bitmask(guides, bitmask)
            return bitmask

        return self._masker.submit(fill)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_ids or token in p.stop_token_ids:
            return "stop"
        if seq.guide is not None:
            if token in self.eos_ids:  # (ignore_eos) the grammar allows EOS only at its end
                return "stop"
            try:
                seq.guide.accept(token)
            except GuideError as exc:  # the mask allowed it: a bug, not the client's fault
                log.error("request %s left its grammar: %s", seq.request_id, exc)
                return "stop"
            if seq.guide.is_finished:  # nothing but EOS may follow
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
            "spec_proposed_tokens": self.spec_proposed,
            "spec_accepted_tokens": self.spec_accepted,
            "spec_verify_steps": self.spec_verifies,
            # accepted / proposed; tokens per verification step (accepted + the target's one)
            "spec_acceptance_rate": self.spec_accepted / max(1, self.spec_proposed),
            "spec_mean_accepted_len": (self.spec_accepted + self.spec_verifies)
            / max(1, self.spec_verifies),
            "pid": os.getpid(),
        }


def _phase_counts(batch: ScheduledBatch) -> tuple[int, int]:
    """(prompt tokens computed, sequences decoding) in a scheduled step, before it advances."""
    prefill_tokens = decodes = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            prefill_tokens += n
        else:
            decodes += 1
    return prefill_tokens, decodes
