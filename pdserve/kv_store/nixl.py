"""The KV store's nixl data path: block bytes move by NIXL READs, control stays on the socket.

Same rule as the nixl KV connector (kv_transfer/nixl.py): **each side READs only into its own
memory**, so nobody's memory is written by a peer it cannot stop.

* Load: the store answers `Load` with where each block's payload lies in its registered memory
  (`NixlLoadReply`) and keeps those blocks pinned (and their buffers alive) until `LoadDone`; the
  client checks the blocks' metadata and READs the verified ones straight into its cache blocks.
  A READ that outlives the load's deadline is given up and the store's agent disconnected before
  `load` returns (on the same host UCX reads by CMA, which completes within the call).
* Put: the client names its cache blocks (or copies in its registered memory) in `NixlPut`; the
  store READs them into buffers of its registered memory and answers `PutRead`; only after the
  client's `Commit` does it keep them. A client that gave up (timeout, exit) never commits, so
  blocks it has reused meanwhile are never stored.

Registered memory is one region per side, registered once (`arena.py`). NIXL runs without its
progress thread; whoever waits on the socket while the peer READs its memory drives its own UCX
progress (`wait_readable`), which wire-up (and UCX's TCP transport) needs.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import TypeVar

import numpy as np

from pdserve.kv_store.arena import Arena
from pdserve.kv_store.config import payload_bytes
from pdserve.kv_store.protocol import (
    Attach,
    AttachReply,
    BlockMeta,
    Commit,
    NixlPut,
    PutRead,
    PutReply,
    recv_reply,
    send_msg,
)
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.nixl_agent import (
    NixlAgent,
    Peer,
    decode_peer_info,
    encode_peer_info,
)
from pdserve.kv_transfer.wire import ClientHello, ProtocolError

log = logging.getLogger("pdserve.kv_store")
T = TypeVar("T")
_PUMP_S = 5e-5  # between progress calls while a peer READs our memory
STORE_HEADROOM = 256 << 20  # registered beyond the DRAM tier: puts and SSD hits in flight
CLIENT_CHUNK = 16 << 20


class NixlTransferError(ConnectionError):
    """A NIXL call failed (peer gone, memory not registered, ...): the transfer did not happen.
    Not a plain ConnectionError, so the client does not retry it as a closed connection."""


@contextmanager
def nixl_errors(what: str):
    """Turn NIXL's own exceptions (plain Exception subclasses) into NixlTransferError."""
    try:
        yield
    except (OSError, ValueError):
        raise
    except Exception as exc:
        raise NixlTransferError(f"{what}: {type(exc).__name__}: {exc}") from exc


def wait_readable(sock: socket.socket, agent: NixlAgent, timeout_s: float) -> None:
    """Return once `sock` has data, driving `agent`'s UCX progress meanwhile (a peer's READ of
    our memory needs it for wire-up, and for the data over UCX's TCP transport): every 50 us
    for the first 100 ms, then every millisecond. TimeoutError after `timeout_s`."""
    poller = select.poll()  # not select(): descriptors above 1024 are fine
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    start = time.monotonic()
    while True:
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise TimeoutError("timed out waiting for the peer")
        if poller.poll(0):
            return
        agent.progress()
        time.sleep(_PUMP_S if waited < 0.1 else 1e-3)  # poll() cannot wait under 1 ms


def _rows(addrs: np.ndarray, nbytes: int) -> np.ndarray:
    """(N, 3) descriptor rows (address, length, device 0) of spans of `nbytes` at `addrs`."""
    flat = addrs.reshape(-1).astype(np.uint64)
    return np.stack([flat, np.full_like(flat, nbytes), np.zeros_like(flat)], axis=1)


def cache_spans(layout: KVLayout, k_addrs, v_addrs, block_ids: Sequence[int]) -> np.ndarray:
    """Per block, per layer: its K then its V span in the caches (the order of a payload); its
    latent's alone for an MLA cache (`v_addrs` empty)."""
    tensors = (k_addrs, v_addrs) if len(v_addrs) else (k_addrs,)
    bases = np.stack([np.asarray(a, np.uint64) for a in tensors], axis=1)
    ids = np.asarray(block_ids, np.uint64) * np.uint64(layout.block_bytes)
    return _rows(bases[None, :, :] + ids[:, None, None], layout.block_bytes)


def payload_spans(layout: KVLayout, addrs: Sequence[int]) -> np.ndarray:
    """Per block, the tensors x num_layers spans of its payload (K0 V0 K1 V1 ..., or the
    latent's L0 L1 ...) at `addrs`."""
    count = layout.tensors * layout.num_layers
    parts = np.arange(count, dtype=np.uint64) * np.uint64(layout.block_bytes)
    return _rows(np.asarray(addrs, np.uint64)[:, None] + parts[None, :], layout.block_bytes)


class NixlStoreServer:
    """The store's NIXL agent and registered memory (the DRAM tier's buffers come from it), and
    the nixl side of every connection."""

    def __init__(self, dram_bytes: int) -> None:
        self.agent = NixlAgent("store", [], progress_thread=False)
        self.arena = Arena(self.agent, dram_bytes + STORE_HEADROOM)
        self.metadata = self.agent.metadata()

    def on_hello(self, hello: ClientHello, layout: KVLayout) -> Peer | None:
        """The client's agent if its hello carries one (a tcp client's does not)."""
        if not hello.extra:
            return None
        info = decode_peer_info(hello.extra, layout.num_layers)
        with nixl_errors("cannot load the client's NIXL metadata"):
            return Peer(self.agent.add_peer(info.agent_metadata), info)

    def on_closed(self, peer: Peer | None) -> None:
        if peer is not None:
            self.agent.drop_peer(peer.agent)

    def servable(self, payload) -> tuple[memoryview, int] | None:
        """`payload` as a buffer of the registered region and its address (copied into one if
        it is elsewhere), or None if the region is full."""
        if (addr := self.arena.address(payload)) is not None:
            return memoryview(payload), addr
        if (slot := self.arena.alloc(len(payload))) is None:
            return None
        slot[:] = memoryview(payload).cast("B")
        return slot, self.arena.address(slot)  # type: ignore[return-value]

    def wait_readable(self, sock: socket.socket, timeout_s: float) -> None:
        """Wait for the client's next request while it READs our memory (`wait_readable`)."""
        wait_readable(sock, self.agent, timeout_s)

    def read_put(
        self, layout: KVLayout, peer: Peer, req: NixlPut, timeout_s: float
    ) -> tuple[list[tuple[BlockMeta, memoryview]] | None, PutRead]:
        """READ the blocks `req` names from the client into new buffers (all or nothing);
        return them and the reply. A READ that failed or timed out is answered with why (None:
        nothing to commit; the buffers are freed): the client sees the failure and the
        connection stays usable. A malformed request raises ProtocolError: the client is
        dropped."""
        try:
            blocks = self._read_blocks(layout, peer, req, timeout_s)
        except NixlTransferError as exc:
            reason = str(exc)  # not `exc`: a log record keeping it would keep the buffers
            log.warning("KV store: a NIXL put from %s failed: %s", peer.agent, reason)
            return None, PutRead(0, reason)
        return blocks, PutRead(len(blocks))

    def _read_blocks(
        self, layout: KVLayout, peer: Peer, req: NixlPut, timeout_s: float
    ) -> list[tuple[BlockMeta, memoryview]]:
        n, size = len(req.blocks), payload_bytes(layout)
        if len(req.block_ids) != n or len(req.copy_addrs) != n:
            raise ProtocolError("NixlPut lists as many block ids and copy addresses as blocks")
        if not all(-1 <= b < peer.info.num_blocks for b in req.block_ids):
            raise ProtocolError(f"block ids outside the client's {peer.info.num_blocks} blocks")
        if not all(0 <= a < 1 << 64 for a in req.copy_addrs):
            raise ProtocolError("copy addresses outside the address space")
        if n == 0:
            return []
        ids = np.asarray(req.block_ids, dtype=np.int64)
        slots = [self.arena.alloc(size) for _ in range(n)]
        if any(s is None for s in slots):
            raise NixlTransferError("the store's registered memory is full")
        addrs = [self.arena.address(s) for s in slots]
        cached = [i for i in range(n) if ids[i] >= 0]
        copies = [i for i in range(n) if ids[i] < 0]
        local = [payload_spans(layout, [addrs[i] for i in cached])]
        remote = [cache_spans(layout, peer.info.k_addrs, peer.info.v_addrs, ids[cached])]
        local.append(_rows(np.asarray([addrs[i] for i in copies], np.uint64), size))
        remote.append(_rows(np.asarray([req.copy_addrs[i] for i in copies], np.uint64), size))
        local_rows, remote_rows = np.concatenate(local), np.concatenate(remote)
        with nixl_errors(f"NIXL READ from {peer.agent}"):
            try:
                self.agent.read(local_rows, remote_rows, peer.agent, timeout_s)
            except (TimeoutError, ConnectionError) as exc:  # the READ itself, not the protocol
                raise NixlTransferError(str(exc)) from exc  # (it names the READ and the peer)
        return list(zip(req.blocks, slots, strict=True))  # type: ignore[arg-type]

    def close(self) -> None:
        self.agent.close()


class NixlStoreClient:
    """A StoreClient's NIXL agent: its caches, plus a region for evicted-block copies."""

    def __init__(self, layout: KVLayout, k_caches, v_caches, copy_bytes: int) -> None:
        self.layout = layout
        self.agent = NixlAgent("store-client", [*k_caches, *v_caches], progress_thread=False)
        chunk = max(CLIENT_CHUNK, payload_bytes(layout))
        self.arena = Arena(self.agent, max(copy_bytes, chunk), chunk_bytes=chunk)
        self.hello = encode_peer_info(self.agent, k_caches[0].shape[0], k_caches, v_caches)
        self._k = [t.data_ptr() for t in k_caches]
        self._v = [t.data_ptr() for t in v_caches]
        self.store_agent: str | None = None

    def attach(self, sock: socket.socket) -> None:
        """On a new load connection: learn the store's agent (StoreError if it has none)."""
        send_msg(sock, Attach())
        metadata = recv_reply(sock, AttachReply).agent_metadata
        with nixl_errors("cannot load the store's NIXL metadata"):
            self.store_agent = self.agent.add_peer(metadata)

    def detach(self) -> None:
        """The load connection is gone: disconnect from the store's agent."""
        if self.store_agent is not None:
            self.agent.drop_peer(self.store_agent)
            self.store_agent = None

    def can_pull(self, source) -> bool:
        """Whether the store can READ this put source: a cache block id, or a copy in the
        registered region (other copies go on the socket)."""
        return isinstance(source, int) or self.arena.address(source) is not None

    def put(
        self,
        sock: socket.socket,
        metas: list[BlockMeta],
        sources: list,
        timeout_s: float,
        reply: Callable[[socket.socket, type[T]], T],
    ) -> int:
        """Have the store READ these blocks (cache block ids, or copies in the region), then
        commit them; return how many it did not hold."""
        ids = [s if isinstance(s, int) else -1 for s in sources]
        copies = [0 if isinstance(s, int) else self.arena.address(s) or 0 for s in sources]
        send_msg(sock, NixlPut(metas, ids, copies))
        wait_readable(sock, self.agent, timeout_s)  # the store READs from us meanwhile
        read = reply(sock, PutRead)
        if read.error is not None or read.read != len(metas):
            raise NixlTransferError(f"the KV store could not read the blocks: {read.error}")
        send_msg(sock, Commit())
        return reply(sock, PutReply).stored

    def read(self, addrs: Sequence[int], dst: Sequence[int], timeout_s: float) -> None:
        """READ the store's payloads at `addrs` into cache blocks `dst`."""
        if not dst:
            return
        if self.store_agent is None:
            raise NixlTransferError("not attached to the store's NIXL agent")
        local = cache_spans(self.layout, self._k, self._v, dst)
        remote = payload_spans(self.layout, addrs)
        with nixl_errors(f"NIXL READ from the KV store ({self.store_agent})"):
            self.agent.read(local, remote, self.store_agent, max(timeout_s, 0.0))

    def snapshot(self, buffers: list) -> memoryview | None:
        """A copy of one block's buffers in the registered region (None if it is full)."""
        slot = self.arena.alloc(payload_bytes(self.layout))
        if slot is None:
            return None
        pos = 0
        for buf in buffers:
            view = memoryview(buf).cast("B")
            slot[pos : pos + len(view)] = view
            pos += len(view)
        return slot

    def close(self) -> None:
        self.agent.close()
