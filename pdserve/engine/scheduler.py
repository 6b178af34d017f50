"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

Queues a request moves through:  waiting -> running -> finished   (role both / prefill)
                                 transferring -> running -> finished   (role decode, remote KV)
Each step: running sequences first (decodes need 1 token; partly prefilled ones the next chunk),
then waiting ones while the budget, the sequence cap and free blocks allow. When a running
sequence needs a block and none is free, the most recently admitted one is preempted: its blocks
are freed and it is recomputed later (its generated tokens are kept).
"""

from __future__ import annotations

from collections import deque

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_connector import KVConnector
from pdserve.engine.sequence import ScheduledBatch, SeqStatus, Sequence


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_size: int | None,
        max_model_len: int,
        chunk_only_under_decodes: bool = False,
        connector: KVConnector | None = None,
    ):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size
        # Without chunking a whole prompt must fit in one step, however long.
        self.whole_budget = max(max_num_batched_tokens, max_model_len)
        self.token_budget = chunk_size or self.whole_budget
        # Chunk only while some running sequence decodes (a decode worker's local prefills:
        # the chunk protects its streams' inter-token latency; with none, it only adds steps).
        self.chunk_only_under_decodes = chunk_only_under_decodes
        self.waiting: deque[Sequence] = deque()
        self.transferring: dict[str, Sequence] = {}
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}  # finished, blocks kept until their KV is sent
        # Told right after a sequence gets blocks: may fill more of its prefix (KVConnector).
        self.connector = connector or KVConnector()
        self.num_preemptions = 0

    @property
    def live(self) -> list[Sequence]:
        """Every sequence that may hold blocks."""
        return [*self.running, *self.transferring.values(), *self.held.values()]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens admitted or waiting but not yet computed (a prefill load signal)."""
        return sum(
            s.num_uncomputed_tokens
            for s in (*self.waiting, *self.running)
            if s.num_uncomputed_tokens > 1
        )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_transferring(self, seq: Sequence) -> bool:
        """Decode role: allocate blocks for a prompt whose KV will arrive from elsewhere.
        Returns False if blocks are short (the caller retries or prefills locally)."""
        if not self.bm.allocate(seq):
            return False
        self.connector.on_allocate(seq, False)  # no step computes this prompt: load it before
        seq.status = SeqStatus.TRANSFERRING
        self.transferring[seq.request_id] = seq
        return True

    def finish_transfer(self, request_id: str) -> Sequence | None:
        """All KV of the prompt has landed: the sequence joins the running batch."""
        seq = self.transferring.pop(request_id, None)
        if seq is None:
            return None
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.bm.register_computed(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return seq

    def resume_local(self, request_id: str) -> Sequence | None:
        """Decode role fallback: the KV never arrived, so compute the prompt here, keeping the
        blocks (and prefix hits) already allocated."""
        seq = self.transferring.pop(request_id, None)
        if seq is None:
            return None
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return seq

    def release_held(self, request_id: str) -> None:
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.bm.free(seq)

    def finish(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> None:
        """Remove seq from whichever queue holds it and free its blocks (or, with keep_blocks,
        hold them until `release_held`)."""
        if seq.status == SeqStatus.FINISHED:
            if not keep_blocks:
                self.release_held(seq.request_id)
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq.request_id in self.transferring:
            del self.transferring[seq.request_id]
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if keep_blocks:
            self.held[seq.request_id] = seq
        else:
            self.bm.free(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def _limits(self) -> tuple[int, int | None]:
        """(token budget, per-sequence chunk) for this step."""
        if self.chunk_only_under_decodes and not any(
            s.num_computed_tokens >= s.num_prompt_tokens for s in self.running
        ):
            return self.whole_budget, None
        return self.token_budget, self.chunk_size

    @staticmethod
    def _chunk(seq: Sequence, budget: int, chunk: int | None) -> int:
        if seq.spec_token_ids:  # a decode verifying proposals: 1 + k tokens, k cut to fit
            del seq.spec_token_ids[max(0, budget - 1) :]
            return min(1 + len(seq.spec_token_ids), budget)
        n = seq.num_uncomputed_tokens
        if chunk is not None:
            n = min(n, chunk)
        return min(n, budget)

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.bm.free(victim)
        victim.spec_token_ids = []
        victim.num_computed_tokens = victim.num_cached_tokens = 0
        victim.status = SeqStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _schedule_running(
        self, budget: int, chunk: int | None
    ) -> tuple[list[Sequence], list[int], int]:
        seqs, counts = [], []
        for seq in list(self.running):
            if seq.status != SeqStatus.RUNNING:  # preempted making room for an earlier one
                continue
            n = self._chunk(seq, budget, chunk)
            if n == 0:
                continue
            while not self.bm.append_slots(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                continue
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return seqs, counts, budget

    def rollback(self, seq: Sequence) -> None:
        """After a verification step: seq's KV is valid for all but its last token; publish
        its full blocks and give back the blocks that only rejected proposals used."""
        seq.spec_token_ids = []
        if seq.is_finished:
            return
        seq.num_computed_tokens = seq.num_tokens - 1
        self.bm.register_computed(seq)
        self.bm.trim(seq, seq.num_tokens)

    def schedule(self) -> ScheduledBatch:
        budget, chunk = self._limits()
        seqs, counts, budget = self._schedule_running(budget, chunk)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.bm.allocate(seq):
                break
            self.connector.on_allocate(seq, True)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = self._chunk(seq, budget, chunk)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def after_step(
        self, batch: ScheduledBatch, void: frozenset[int] = frozenset()
    ) -> list[Sequence]:
        """Advance counters; return the sequences whose whole context is now computed (they
        get a sampled token). Sequences in `void` (by id) are not advanced: what this step
        computed for them is recomputed by a later one. Sequences verifying proposals are
        advanced by the engine once it knows how many were accepted (`rollback`)."""
        done = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if id(seq) in void or seq.spec_token_ids:
                continue
            seq.num_computed_tokens += n
            self.bm.register_computed(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                done.append(seq)
        return done
