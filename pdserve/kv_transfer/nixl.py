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

The agent and the peer info in the hello are shared with the KV store: `kv_transfer/nixl_agent.py`.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from pdserve.kv_transfer.layout import KVLayout, whole_rank
from pdserve.kv_transfer.memory import layer_caches, paired_runs
from pdserve.kv_transfer.nixl_agent import NixlAgent, Peer, decode_peer_info, encode_peer_info
from pdserve.kv_transfer.send_queue import Job
from pdserve.kv_transfer.tcp import TcpSender
from pdserve.kv_transfer.tcp_receiver import TcpReceiver
from pdserve.kv_transfer.transfer_table import WriteTicket
from pdserve.kv_transfer.wire import ClientHello, LayerHeader, ProtocolError, wait_hangup

log = logging.getLogger(__name__)
_IDLE_PROGRESS_S = 0.005  # an idle sender still answers a READ of a layer it gave up this fast


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
        K, then of V (or of the latent), of the sender rank whose blocks are ours as they are."""
        bb, layer = self.layout.block_bytes, hdr.layer
        # one descriptor per run of blocks consecutive on both sides: UCX pays per descriptor,
        # so 6 KiB single-block descriptors run at a fraction of the bandwidth of long spans
        runs = np.array(paired_runs(hdr.src_block_ids, hdr.dst_block_ids), dtype=np.uint64)
        src, dst, size = runs[:, 0] * bb, runs[:, 1] * bb, runs[:, 2] * bb
        zero = np.zeros(len(runs), dtype=np.uint64)
        remote_base = [a[layer] for a in peer.info.addrs(peer.whole)]
        local_base = [t.data_ptr() for t in layer_caches(self.k_caches, self.v_caches, layer)]
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
        local_base = [t.data_ptr() for t in layer_caches(self.k_caches, self.v_caches, layer)]
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
