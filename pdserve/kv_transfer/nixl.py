"""NIXL connector (optional extra: `pip install nixl-cu12==1.5.1`): block bytes move through
NVIDIA NIXL and its UCX backend (shared memory / TCP / RDMA, whatever UCX finds; CPU memory here).

The control path is the tcp connector's: same handshake (layout check, optional HMAC), same
per-layer headers and acknowledgements, so the same `nixl://HOST:PORT` endpoint. The data path
differs: the sender registers its caches with its NIXL agent and passes its agent metadata and
cache base addresses in the handshake; for each announced layer the *receiver* issues a NIXL
READ from the sender's blocks straight into its own registered blocks, then acknowledges.

Why the receiver pulls (like vLLM's NixlConnector) rather than the sender writing: a one-sided
WRITE could land in any registered block, so the receiver could neither refuse blocks it did not
register for that transfer nor guarantee that nothing lands after `release`. Pulling keeps every
write into decode memory under the receiver's TransferTable, exactly as with tcp. A layer's READ
is not interruptible: `release` waits for an in-flight READ to finish (milliseconds), and a
READ given up past its timeout is waited for too (its peer disconnected if it runs on).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import numpy as np

from pdserve import envs
from pdserve.kv_transfer.base import HeadSegment, KVLayout, whole_rank
from pdserve.kv_transfer.memory import paired_runs
from pdserve.kv_transfer.send_queue import Job
from pdserve.kv_transfer.tcp import TcpSender
from pdserve.kv_transfer.tcp_receiver import TcpReceiver
from pdserve.kv_transfer.transfer_table import WriteTicket
from pdserve.kv_transfer.wire import ClientHello, LayerHeader, ProtocolError, wait_hangup

log = logging.getLogger(__name__)
INSTALL_HINT = (
    "the nixl KV transport needs NVIDIA NIXL: pip install nixl-cu12==1.5.1 (the pdserve[nixl] "
    "extra), or use the built-in tcp transport"
)
_READ_TIMEOUT_S = 30.0
_FINISH_WAIT_S = 10.0  # a READ given up may run on this long before its peer is disconnected
_SPIN_S = 1e-3  # poll without sleeping this long: most layer READs finish within it
_HANGUP_CHECK_S = 0.01  # how often a READ under way checks that its sender still waits for it
_IDLE_PROGRESS_S = 0.005  # an idle sender still answers a READ of a layer it gave up this fast


def _nixl_api():
    """(nixl_agent, nixl_agent_config) from whichever NIXL wheel is installed."""
    os.environ.setdefault(envs.NIXL_LOG_LEVEL, "WARN")  # NIXL logs every agent at INFO otherwise
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent"])
            return api.nixl_agent, api.nixl_agent_config
        except ImportError:
            continue
    raise ImportError(INSTALL_HINT)


class NixlPeerInfo(msgspec.Struct, frozen=True):
    """What a sender tells the receiver in its hello: how to reach and read its caches."""

    agent_metadata: bytes
    num_blocks: int  # of the sender's caches: the receiver reads only inside them
    k_addrs: list[int]  # base address of each layer's K cache
    v_addrs: list[int]
    # ranks 1.. of a tensor-parallel group: their (K, V) base addresses per layer
    other_ranks: list[tuple[list[int], list[int]]] = []

    def addrs(self, rank: int) -> tuple[list[int], list[int]]:
        """(K, V) base addresses per layer of rank `rank`'s caches."""
        return (self.k_addrs, self.v_addrs) if rank == 0 else self.other_ranks[rank - 1]


class Peer(NamedTuple):
    """A connected peer's agent (as added to ours), what its hello said, and where each of our
    heads comes from in its group (`KVLayout.segments_from`; `whole`: the rank whose blocks are
    ours as they are, or None)."""

    agent: str
    info: NixlPeerInfo
    layout: KVLayout | None = None
    segments: tuple[HeadSegment, ...] = ()
    whole: int | None = 0


class NixlAgent:
    """A NIXL agent with the given caches registered; calls are serialized by a lock. Shared by
    this connector and the KV store's nixl path (pdserve/kv_store/nixl.py)."""

    def __init__(self, role: str, caches, progress_thread: bool) -> None:
        nixl_agent, nixl_agent_config = _nixl_api()
        self.name = f"pdserve-kv-{role}-{uuid.uuid4().hex[:12]}"
        self.lock = threading.Lock()
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        self.agent = nixl_agent(self.name, config)
        self._registered = [self.agent.register_memory(list(caches))] if caches else []
        self.peers: dict[str, int] = {}  # remote agent name -> live connections using it

    def register(self, address: int, nbytes: int) -> None:
        """Also register `nbytes` of CPU memory at `address` (deregistered by `close`)."""
        with self.lock:
            self._registered.append(self.agent.register_memory([(address, nbytes, 0, "")], "DRAM"))

    def metadata(self) -> bytes:
        """This agent's metadata: how peers reach it and read its registered memory."""
        with self.lock:
            return self.agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a remote agent's metadata; return its name. Counted: `drop_peer` once per call."""
        with self.lock:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self.peers[name] = self.peers.get(name, 0) + 1
        return name

    def drop_peer(self, name: str) -> None:
        """One user of `name` is gone; the last one disconnects it."""
        with self.lock:
            if name not in self.peers:
                return  # close() already dropped every peer
            self.peers[name] -= 1
            if self.peers[name] == 0:  # the same peer may have reconnected meanwhile
                del self.peers[name]
                self.agent.remove_remote_agent(name)

    def progress(self) -> None:
        """Drive this agent's UCX workers once (wire-up, and data over UCX's TCP transport)."""
        with self.lock:
            self.agent.get_new_notifs()

    def read(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        peer_agent: str,
        timeout_s: float = _READ_TIMEOUT_S,
        hung_up: Callable[[], bool] | None = None,
    ) -> None:
        """READ the (N, 3) rows (address, length, 0) of `remote` into those of `local`; wait for
        it. TimeoutError past `timeout_s` (once the READ has ended: no byte lands in `local`
        after this returns or raises), ConnectionError if it failed, or if `hung_up()` says
        the sender gave it up (then the peer is disconnected at once, which ends the READ)."""
        with self.lock:
            local_d = self.agent.get_xfer_descs(local, "DRAM")
            remote_d = self.agent.get_xfer_descs(remote, "DRAM")
            handle = self.agent.initialize_xfer("READ", local_d, remote_d, peer_agent)
            state = self.agent.transfer(handle)
        start = next_check = time.monotonic()
        while state == "PROC":
            now = time.monotonic()
            waited = now - start
            if waited > timeout_s:
                self._finish(handle, peer_agent)
                raise TimeoutError(f"NIXL READ from {peer_agent} took over {timeout_s} s")
            if hung_up is not None and now >= next_check:
                next_check = now + _HANGUP_CHECK_S
                if hung_up():
                    self._finish(handle, peer_agent, wait_s=0.0)
                    raise ConnectionError(f"the sender {peer_agent} hung up during a READ")
            time.sleep(0 if waited < _SPIN_S else 1e-4)  # then back off: two cores are shared
            with self.lock:
                state = self.agent.check_xfer_state(handle)
        with self.lock:
            handle.release()
        if state != "DONE":
            raise ConnectionError(f"NIXL READ from {peer_agent} failed ({state})")

    def _finish(self, handle, peer_agent: str, wait_s: float = _FINISH_WAIT_S) -> None:
        """Wait for a READ that `read` gave up to end, so that none of its bytes lands after
        `read` has returned (the caller frees or reuses the destination then). Releasing the
        handle does not stop a READ under way (seen with UCX over tcp: the bytes landed after
        the release). A peer that does not end it within `_FINISH_WAIT_S` is disconnected,
        which fails every transfer with it."""
        if self._ended(handle, wait_s):
            return
        log.warning("a NIXL READ from %s is still under way %.0f s after it was given up: "
                    "disconnecting the peer", peer_agent, wait_s)  # fmt: skip
        with self.lock:
            if self.peers.pop(peer_agent, None) is not None:
                self.agent.remove_remote_agent(peer_agent)
        if not self._ended(handle, _FINISH_WAIT_S):
            log.error("a NIXL READ from %s is still under way after its peer was disconnected; "
                      "its destination may still be written", peer_agent)  # fmt: skip

    def _ended(self, handle, seconds: float) -> bool:
        """Poll a READ for up to `seconds`; once it is no longer under way, release its handle
        and return True."""
        deadline = time.monotonic() + seconds
        while True:
            with self.lock:
                try:
                    ended = self.agent.check_xfer_state(handle) != "PROC"
                except Exception:  # NIXL_ERR_NOT_FOUND: its peer was disconnected, it ended
                    return True
                if ended:
                    handle.release()
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(1e-3)

    def close(self) -> None:
        with self.lock:
            for name in self.peers:
                self.agent.remove_remote_agent(name)
            self.peers.clear()
            for registered in self._registered:
                self.agent.deregister_memory(registered)
            self._registered = []


def encode_peer_info(
    agent: NixlAgent, num_blocks: int, k_caches, v_caches, other_ranks=()
) -> bytes:
    """The hello `extra` that lets a peer read `agent`'s registered caches (and those of the
    other ranks of a tensor-parallel group: `other_ranks`, (k_caches, v_caches) of ranks 1..)."""

    def addrs(caches) -> list[int]:
        return [t.data_ptr() for t in caches]

    info = NixlPeerInfo(
        agent.metadata(),
        num_blocks,
        addrs(k_caches),
        addrs(v_caches),
        [(addrs(k), addrs(v)) for k, v in other_ranks],
    )
    return msgspec.msgpack.encode(info)


def decode_peer_info(extra: bytes, num_layers: int, tp_size: int = 1) -> NixlPeerInfo:
    """The NixlPeerInfo of a hello; ProtocolError if malformed or not one address per layer of
    each of the `tp_size` ranks."""
    try:
        info = msgspec.msgpack.decode(extra, type=NixlPeerInfo)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad NIXL peer info: {exc}") from exc
    if len(info.other_ranks) != tp_size - 1:
        ranks = len(info.other_ranks) + 1
        raise ProtocolError(f"NIXL peer info lists {ranks} ranks, not {tp_size}")
    if any(len(a) != num_layers for rank in range(tp_size) for a in info.addrs(rank)):
        raise ProtocolError("NIXL peer info does not list one K and V address per layer")
    return info


class NixlSender(TcpSender):
    """Prefill side: exposes its caches to authenticated receivers, which read the blocks."""

    scheme = "nixl"

    def __init__(
        self, layout: KVLayout, k_caches, v_caches, *, progress_thread: bool = False, **options
    ) -> None:
        if options.get("compression"):
            raise ValueError("the nixl transport moves raw blocks; compression is tcp-only")
        super().__init__(layout, k_caches, v_caches, **options)
        caches = [t for k, v in self.ranks for t in (*k, *v)]
        self._agent = NixlAgent("send", caches, progress_thread)
        self._stop = threading.Event()
        self._pump = threading.Thread(target=self._pump_progress, name="nixl-pump", daemon=True)
        self._pump.start()
        self._hello = encode_peer_info(
            self._agent, self.num_blocks, k_caches, v_caches, self.ranks[1:]
        )

    def _hello_extra(self) -> bytes:
        return self._hello

    def _write_payload(self, sock, job: Job, link) -> None:
        pass  # the receiver reads the blocks itself after the header

    def _pump_progress(self) -> None:
        """Drive this agent's UCX worker while layers await acknowledgement: the receiver's READ
        needs the target to answer connection wire-up (and, over UCX's TCP transport, the data
        itself). NIXL's own progress thread would do it by spinning a core even when idle."""
        while not self._stop.is_set():
            busy = self._tracker.wait_busy(timeout_s=_IDLE_PROGRESS_S)
            self._agent.progress()  # idle too: a receiver may still READ a layer given up
            if busy:
                time.sleep(5e-5)

    def close(self) -> None:
        super().close()
        self._stop.set()
        self._pump.join(timeout=5)
        self._agent.close()


class NixlReceiver(TcpReceiver):
    """Decode side: validates each announced layer, then READs it into the registered blocks."""

    scheme = "nixl"
    encodings = ("raw",)

    def __init__(
        self, layout, k_caches, v_caches, host="127.0.0.1", *, progress_thread=False, **options
    ) -> None:
        super().__init__(layout, k_caches, v_caches, host, **options)
        self._agent = NixlAgent("recv", [*k_caches, *v_caches], progress_thread)

    def _on_peer(self, hello: ClientHello) -> Peer:
        sender = hello.layout
        info = decode_peer_info(hello.extra, self.layout.num_layers, sender.tp_size)
        segments = self.layout.segments_from(sender)  # the handshake checked it maps
        whole = whole_rank(segments, self.layout, sender)
        return Peer(self._agent.add_peer(info.agent_metadata), info, sender, tuple(segments), whole)

    def _on_peer_closed(self, peer: Peer | None) -> None:
        if peer is not None:
            self._agent.drop_peer(peer.agent)

    def _skip_payload(self, conn, hdr: LayerHeader) -> None:
        pass  # nothing follows the header on the socket

    def _land(self, conn, hdr: LayerHeader, ticket: WriteTicket, peer: Peer) -> None:
        if ticket.released or not hdr.dst_block_ids:
            return
        if not all(0 <= b < peer.info.num_blocks for b in hdr.src_block_ids):
            raise ProtocolError(
                f"source block ids outside the sender's {peer.info.num_blocks} blocks"
            )
        if peer.whole is not None:
            local, remote = self._whole_spans(hdr, peer)
        else:
            local, remote = self._head_spans(hdr, peer)
        self._agent.read(local, remote, peer.agent, hung_up=lambda: wait_hangup(conn, 0))

    def _whole_spans(self, hdr: LayerHeader, peer: Peer) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) (N, 3) rows of (address, length, device id): every run of blocks of
        K, then of V, of the sender rank whose blocks are ours as they are."""
        bb, layer = self.layout.block_bytes, hdr.layer
        # one descriptor per run of blocks consecutive on both sides: UCX pays per descriptor,
        # so 6 KiB single-block descriptors run at a fraction of the bandwidth of long spans
        runs = np.array(paired_runs(hdr.src_block_ids, hdr.dst_block_ids), dtype=np.uint64)
        src, dst, size = runs[:, 0] * bb, runs[:, 1] * bb, runs[:, 2] * bb
        zero = np.zeros(len(runs), dtype=np.uint64)
        remote_base = [a[layer] for a in peer.info.addrs(peer.whole)]
        local_base = (self.k_caches[layer].data_ptr(), self.v_caches[layer].data_ptr())
        remote = np.concatenate([np.stack([b + src, size, zero], 1) for b in remote_base])
        local = np.concatenate([np.stack([b + dst, size, zero], 1) for b in local_base])
        return local, remote

    def _head_spans(self, hdr: LayerHeader, peer: Peer) -> tuple[np.ndarray, np.ndarray]:
        """Re-sharding: one row per token of each block and segment of our heads, from the
        sender rank that holds them (the cache is [block, token, head, dim]: a head slice of a
        block is `block_size` strided spans)."""
        lay, layer = self.layout, hdr.layer
        head = np.uint64(lay.head_dim * lay.itemsize)  # bytes of one head of one token
        tokens = np.arange(lay.block_size, dtype=np.uint64)
        src_ids = np.asarray(hdr.src_block_ids, dtype=np.uint64)[:, None]
        dst_ids = np.asarray(hdr.dst_block_ids, dtype=np.uint64)[:, None]
        dst_row = np.uint64(lay.num_kv_heads) * head
        local_base = (self.k_caches[layer].data_ptr(), self.v_caches[layer].data_ptr())
        local, remote = [], []
        for seg in peer.segments:
            src_row = np.uint64(peer.layout.shard(seg.src_rank).num_kv_heads) * head
            src = src_ids * (src_row * np.uint64(lay.block_size)) + tokens * src_row
            src = (src + np.uint64(seg.src_head) * head).ravel()
            dst = dst_ids * (dst_row * np.uint64(lay.block_size)) + tokens * dst_row
            dst = (dst + np.uint64(seg.dst_head) * head).ravel()
            size = np.full(len(src), np.uint64(seg.count) * head, dtype=np.uint64)
            zero = np.zeros(len(src), dtype=np.uint64)
            remote_base = [a[layer] for a in peer.info.addrs(seg.src_rank)]
            for rb, lb in zip(remote_base, local_base, strict=True):
                remote.append(np.stack([np.uint64(rb) + src, size, zero], 1))
                local.append(np.stack([np.uint64(lb) + dst, size, zero], 1))
        return np.concatenate(local), np.concatenate(remote)

    def close(self) -> None:
        super().close()
        self._agent.close()
