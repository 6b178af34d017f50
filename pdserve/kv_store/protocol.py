"""The store's socket protocol: typed msgspec frames, raw block payloads, limits, handshake.

A connection starts with the KV fabric's handshake (`pdserve.kv_transfer.wire`: version, the
client's `KVLayout`, optional HMAC challenge-response with the shared secret). The store accepts
every layout: the layout of the connection is part of the key of every block it touches. Then the
client sends requests and reads one reply each, in order:

    Query(hashes, pin_s)   -> QueryReply(present, removed) (optionally pins the leading hits)
    Put(blocks) + payloads -> PutReply(stored, removed)    payload per block: K0 V0 K1 V1 ...
    Load(hashes)           -> LoadReply(blocks) + payload  layer-major: per layer all K, all V
    GetStats()             -> StatsReply(stats)
    any bad request        -> Error(reason), then the server closes the connection

A store started with the nixl transport also serves clients whose hello carries their NIXL
agent (`kv_transfer.nixl_agent.NixlPeerInfo`); their block bytes move by NIXL READs, never on the
socket, and each side READs only into its own memory (docs/kv_store.md):

    Attach()                  -> AttachReply(agent metadata)       before the first NixlLoad
    NixlPut(blocks, block_ids, copy_addrs)
                              -> PutRead(read)     the store has READ the blocks from the client
    Commit()                  -> PutReply(stored, removed)  only now does the store keep them
    Load(hashes)              -> NixlLoadReply(blocks, addrs)  (on an attached connection)
    LoadDone()                -> Done(removed)     the store held the blocks until now

Every frame is a 4-byte big-endian length and one msgpack message of at most `MAX_FRAME_BYTES`;
a message names at most `MAX_BLOCKS` blocks. Payload sizes follow from the layout, never from the
peer, so a lying header cannot make either side read or allocate more than it expects.

`removed` in a reply lists blocks of the connection's layout that left the store since its
previous reply (at most `MAX_REMOVED`; the rest follow in later replies): clients forward them so
that the router's index of what the store holds also shrinks.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from typing import TypeVar

import msgspec

from pdserve.engine.block_hash import hash_block
from pdserve.kv_transfer.wire import ProtocolError, recv_exact

MAX_FRAME_BYTES = 4 << 20
MAX_BLOCKS = 1024
MAX_REMOVED = 4096  # removed hashes per reply (~37 KB of msgpack)
_IOV_MAX = 1024  # buffers per sendmsg call (Linux's IOV_MAX)
_LEN = struct.Struct("!I")
T = TypeVar("T")


class BlockMeta(msgspec.Struct, frozen=True, array_like=True):
    """What identifies a block's content: its hash, the hash it chains from, its token ids."""

    block_hash: int
    parent: int | None
    token_ids: list[int]


def chains(meta: BlockMeta) -> bool:
    """Whether `meta`'s token ids, chained from its parent, hash to its block hash (False for
    values no engine could have produced, e.g. token ids beyond int32)."""
    try:
        return hash_block(meta.parent, meta.token_ids) == meta.block_hash
    except (struct.error, OverflowError):
        return False


class StoreStats(msgspec.Struct, frozen=True):
    """Counters (monotonic) and gauges (current size) of one store process."""

    hits_dram: int = 0
    hits_ssd: int = 0
    misses: int = 0
    blocks_put: int = 0
    blocks_put_duplicate: int = 0
    blocks_rejected: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    demotions: int = 0
    evictions_dram: int = 0
    evictions_ssd: int = 0
    corrupt_dropped: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    dram_blocks: int = 0
    dram_bytes: int = 0
    ssd_blocks: int = 0
    ssd_bytes: int = 0
    pinned_blocks: int = 0


class Query(msgspec.Struct, tag="query", frozen=True):
    block_hashes: list[int]
    pin_s: float = 0.0


class QueryReply(msgspec.Struct, tag="query_reply", frozen=True):
    present: list[bool]
    removed: list[int] = []  # block hashes that left the store since the previous reply


class Put(msgspec.Struct, tag="put", frozen=True):
    blocks: list[BlockMeta]


class PutReply(msgspec.Struct, tag="put_reply", frozen=True):
    stored: int
    removed: list[int] = []


class Load(msgspec.Struct, tag="load", frozen=True):
    block_hashes: list[int]


class LoadReply(msgspec.Struct, tag="load_reply", frozen=True):
    blocks: list[BlockMeta]


class GetStats(msgspec.Struct, tag="get_stats", frozen=True):
    pass


class StatsReply(msgspec.Struct, tag="stats_reply", frozen=True):
    stats: StoreStats


class Error(msgspec.Struct, tag="error", frozen=True):
    reason: str


class Attach(msgspec.Struct, tag="attach", frozen=True):
    pass


class AttachReply(msgspec.Struct, tag="attach_reply", frozen=True):
    agent_metadata: bytes  # the store's NIXL agent: how to reach and read its registered memory


class NixlPut(msgspec.Struct, tag="nixl_put", frozen=True):
    blocks: list[BlockMeta]
    block_ids: list[int]  # per block: the client's cache block holding it, or -1: a copy ...
    copy_addrs: list[int]  # ... at this address of the client's registered memory (else 0)


class PutRead(msgspec.Struct, tag="put_read", frozen=True):
    read: int  # blocks READ from the client; kept only if the client commits
    error: str | None = None  # why the store could not READ them


class Commit(msgspec.Struct, tag="commit", frozen=True):
    pass


class NixlLoadReply(msgspec.Struct, tag="nixl_load_reply", frozen=True):
    blocks: list[BlockMeta]
    addrs: list[int]  # per block: its payload (K0 V0 K1 V1 ...) in the store's registered memory


class LoadDone(msgspec.Struct, tag="load_done", frozen=True):
    pass


class Done(msgspec.Struct, tag="done", frozen=True):
    removed: list[int] = []


Request = Query | Put | Load | GetStats | Attach | NixlPut | Commit | LoadDone
Reply = (
    QueryReply | PutReply | LoadReply | StatsReply | Error | AttachReply | PutRead
    | NixlLoadReply | Done
)  # fmt: skip
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class StoreError(ConnectionError):
    """The store answered with an error, or the connection to it broke the protocol."""


def send_msg(sock: socket.socket, msg: Request | Reply) -> None:
    data = _encoder.encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket, decoder: msgspec.msgpack.Decoder):
    size = _LEN.unpack(recv_exact(sock, _LEN.size))[0]
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        return decoder.decode(recv_exact(sock, size))
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed frame: {exc}") from exc


def recv_request(sock: socket.socket) -> Request:
    """One request; ProtocolError if oversized, malformed or naming too many blocks."""
    msg = _recv(sock, _request_decoder)
    blocks = getattr(msg, "blocks", None) or getattr(msg, "block_hashes", None) or ()
    if len(blocks) > MAX_BLOCKS:
        raise ProtocolError(f"request names {len(blocks)} blocks; the limit is {MAX_BLOCKS}")
    return msg


def recv_reply(sock: socket.socket, kind: type[T]) -> T:
    """The reply to the last request, checked to be a `kind` (an Error becomes StoreError)."""
    msg = _recv(sock, _reply_decoder)
    if isinstance(msg, Error):
        raise StoreError(f"the KV store refused the request: {msg.reason}")
    if not isinstance(msg, kind):
        raise ProtocolError(f"expected {kind.__name__} from the KV store, got {type(msg).__name__}")
    return msg


def send_buffers(sock: socket.socket, buffers: Sequence) -> int:
    """Send every buffer in order with scatter-gather writes (no joining copy); return bytes."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    total, i = sum(len(v) for v in views), 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_MAX])
        while sent:  # advance past what went out; a partial buffer keeps its tail
            if sent >= len(views[i]):
                sent -= len(views[i])
                i += 1
            else:
                views[i], sent = views[i][sent:], 0
    return total
