"""One request's state inside an engine: token ids, counters, block table and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from pdserve.engine.sampling_params import SamplingParams


class SeqStatus(enum.IntEnum):
    WAITING = 0  # queued; no blocks yet
    TRANSFERRING = 1  # decode role: blocks held under a lease, KV arriving from a prefill worker
    RUNNING = 2  # in the batch (prefilling in chunks, or decoding)
    FINISHED = 3


class PrefixLoad(Protocol):
    """KV of prompt tokens [first_token, first_token + num_tokens) arriving from outside (the KV
    store) while the step that computes the rest of the prompt runs. The model calls
    `wait_layer(i)` before layer i reads the cache; the engine calls `finish()` after the step,
    which waits for the load to end and returns how many of those tokens landed intact (a
    prefix of the range, a multiple of the block size)."""

    first_token: int
    num_tokens: int

    def wait_layer(self, layer: int) -> None: ...

    def finish(self) -> int: ...


@dataclass(eq=False)  # one request's state: the same object, not equal fields (and `seq in
# running` costs an identity test, not a comparison of every field: 2 ms a step of 64)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # of full, computed blocks
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at admission (not recomputed)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    generator: object | None = None  # torch.Generator when the request has a seed
    prefix_load: PrefixLoad | None = None  # in flight during the step after admission only
    num_replayed: int = 0  # output tokens at the end of the prompt (a migrated request's replay)
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprobs per prompt token >= 1
    guide: object | None = None  # engine.guided.Guide when the output is constrained
    # proposed tokens this step verifies (engine/spec_decode.py): never in token_ids, never
    # hashed into the prefix cache; empty outside a step
    spec_token_ids: list[int] = field(default_factory=list)
    # decayed counts of proposals accepted / tried (a rejection ends a try): how many to propose
    spec_hits: float = 3.0
    spec_tries: float = 4.0
    ngrams: object | None = None  # prompt lookup's index of this sequence's n-grams

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        """The client's prompt (without replayed output tokens)."""
        return self.token_ids[: self.num_prompt_tokens - self.num_replayed]

    @property
    def generated_token_ids(self) -> list[int]:
        """Every output token of the request, replayed ones included (penalties count them)."""
        return self.token_ids[self.num_prompt_tokens - self.num_replayed :]

    def step_token_ids(self) -> list[int]:
        """The tokens a step computes from: token_ids, then any proposed ones."""
        return self.token_ids + self.spec_token_ids if self.spec_token_ids else self.token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Extra blocks the table needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))


class ScheduledBatch(NamedTuple):
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens computed this step, per sequence

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)
