"""Typed control-plane messages (msgspec, tagged union, msgpack on the wire). Nothing is ever
unpickled from the network: a frame that does not decode into one of these is dropped.

Router <-> decode worker D, prefill worker P (lifecycle in docs/architecture.md):
  worker -> router: Register, Heartbeat, Placement, PrefillDone, Tokens, Failed
  router -> worker: RegisterAck, Admit, Prefill, KVReady, Abort, Shutdown, Reset, RouterBeat
"""

from __future__ import annotations

import msgspec

from pdserve.kv_transfer.layout import KVLayout
from pdserve.protocol.sampling import SamplingParams

# The sampling type under the name the worker code and its tests use (m.Params): one type.
Params = SamplingParams


class Logprobs(msgspec.Struct, array_like=True):
    """One token's logprob and the top ones as (token id, logprob), most likely first."""

    logprob: float
    top: list[tuple[int, float]] = []

    @classmethod
    def of(cls, lp) -> Logprobs | None:
        """From the engine's TokenLogprobs (None stays None)."""
        return None if lp is None else cls(lp.logprob, list(lp.top))


class Register(msgspec.Struct, tag=True):
    worker_id: str
    role: str  # prefill | decode | both
    layout: KVLayout
    kv_endpoint: str | None  # where a decode worker receives KV
    total_blocks: int
    max_model_len: int
    pid: int = 0
    has_store: bool = False  # loads prefixes from / offloads blocks to a KV store
    cached: list[int] = []  # block hashes in its prefix cache (a new router's index starts here)
    placement: dict[str, str] = {}  # where it runs: host; under Ray its node and actor ids
    kv_compression: str = "none"  # its KV pushes on the wire: none | fp8
    kv_transport: str = "tcp"  # how it moves KV (tcp | nixl): prefill and decode share one


class RegisterAck(msgspec.Struct, tag=True):
    ok: bool
    error: str | None = None


class Load(msgspec.Struct):
    waiting: int
    transferring: int
    running: int
    queued_tokens: int  # prompt tokens not yet computed
    free_blocks: int
    total_blocks: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    preemptions: int
    integrity_error: str | None = None  # check_integrity() of the block manager
    store_hit_tokens: int = 0  # prompt tokens loaded from the KV store instead of computed
    store_query_tokens: int = 0
    prefill_tok_s: float = 0.0  # measured prefill speed (0: not measured yet); admission control
    decode_step_s: float = 0.0  # measured seconds per step while decoding (each stream's TPOT)
    leases_expired: int = 0  # KV leases that expired before their KV arrived, since it started
    # speculative decoding (engine/spec_decode.py): proposed / accepted tokens, verify steps
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_len: float = 0.0  # tokens emitted per verify step


class Heartbeat(msgspec.Struct, tag=True):
    worker_id: str
    load: Load | None
    stored: list[int] = []  # block hashes newly cached (KV events for the router's index)
    removed: list[int] = []
    offloaded: list[int] = []  # block hashes this worker wrote to (or loaded from) the KV store
    store_removed: list[int] = []  # block hashes the KV store reported evicted


class Admit(msgspec.Struct, tag=True):
    """Router -> D: take a request. remote_prefill=True: allocate blocks and answer Placement."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    remote_prefill: bool
    lease_s: float  # how long D holds blocks for remote KV (RouterConfig.lease_s)
    skip_tokens: int = 0  # output tokens already streamed to the client (migration replay)
    trace: str = ""  # W3C traceparent of the router's request span ("": not traced)


class Placement(msgspec.Struct, tag=True):
    """D -> router: blocks held under a lease for the request's KV."""

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int
    kv_endpoints: list[str]  # where its KV lands: one per rank of D's tensor-parallel group


class Prefill(msgspec.Struct, tag=True):
    """Router -> P: compute the prompt, push KV of blocks from dst_start_block on into D."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    kv_endpoints: list[str]  # D's ranks: each is pushed its own KV heads
    dst_block_ids: list[int]  # D's blocks for the whole prompt
    num_cached_tokens: int  # D already holds these (whole blocks): not sent
    trace: str = ""  # W3C traceparent of the router's request span ("": not traced)


class PrefillDone(msgspec.Struct, tag=True):
    request_id: str
    first_token: int | None
    error: str | None = None
    logprobs: Logprobs | None = None  # of the first token, when the request asked
    prompt_logprobs: list[Logprobs] | None = None
    transfer_bytes: int = 0
    transfer_s: float = 0.0  # first layer queued -> last layer acknowledged
    prefill_s: float = 0.0  # Prefill received -> KV all on the decode worker
    exposed_s: float = 0.0  # after the forward pass, waiting for the last layers to land
    queue_s: float = 0.0  # Prefill received -> its first chunk scheduled
    compute_s: float = 0.0  # first chunk scheduled -> the last chunk's forward pass ended


class KVReady(msgspec.Struct, tag=True):
    """Router -> D: every layer was pushed; the request joins D's running batch.
    first_token None: the prefill failed, so D prefills the prompt itself."""

    request_id: str
    first_token: int | None


class TokenOut(msgspec.Struct, array_like=True):
    request_id: str
    index: int  # position in the output (0 = first token)
    token: int
    finish_reason: str | None
    logprobs: Logprobs | None = None  # when the request asked
    prompt_logprobs: list[Logprobs] | None = None  # with the first token, when asked


class Tokens(msgspec.Struct, tag=True):
    worker_id: str
    items: list[TokenOut]


class Failed(msgspec.Struct, tag=True):
    """Worker -> router: the request cannot go on here; the message is for the client."""

    request_id: str
    error: str
    status: int = 500


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class RouterBeat(msgspec.Struct, tag=True):
    """Router -> worker, answering each of its heartbeats: the router is there. A worker that
    hears nothing for its --router-timeout-s frees what it held (see Worker.orphan)."""


class Draining(msgspec.Struct, tag=True):
    """Worker -> router: it is draining (SIGTERM, scale-down): place nothing new on it; what
    it holds finishes there."""

    worker_id: str


class Leaving(msgspec.Struct, tag=True):
    """Worker -> router: it exits now, drained (nothing left) or past its drain deadline (what
    it still holds migrates). Not a failure."""

    worker_id: str


class Reset(msgspec.Struct, tag=True):
    """Router -> a worker it had declared dead, or does not know (the router restarted): drop
    every request, free blocks, register again."""


Message = (
    Register
    | RegisterAck
    | Heartbeat
    | Admit
    | Placement
    | Prefill
    | PrefillDone
    | KVReady
    | Tokens
    | Failed
    | Abort
    | Shutdown
    | Reset
    | RouterBeat
    | Draining
    | Leaving
)
ROUTER_TIMEOUT_S = 15.0  # default silence of the router before a worker drops its requests
TRANSFER_TIMEOUT_S = 30.0  # default wait of a prefill worker for its push's acknowledgements
DRAIN_TIMEOUT_S = 30.0  # default time a draining worker or server lets its requests finish
MAX_MESSAGE_BYTES = 64 << 20  # a 1M-token prompt fits; anything larger is refused
