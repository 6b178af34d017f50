"""What the NIXL KV connector (`kv_transfer/nixl.py`) and the KV store's NIXL path
(`kv_store/nixl.py`) share: a NIXL agent with memory registered (`NixlAgent`: peers counted,
READs waited for, one given up ended before it returns) and the peer info a hello carries so
the other side can READ that memory (`NixlPeerInfo`, `encode_peer_info`, `decode_peer_info`;
`Peer`, a connected one). Needs the optional NIXL wheel (`pip install nixl-cu12==1.5.1`)."""

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
from pdserve.kv_transfer.layout import HeadSegment, KVLayout
from pdserve.kv_transfer.wire import ProtocolError

log = logging.getLogger(__name__)
INSTALL_HINT = (
    "the nixl KV transport needs NVIDIA NIXL: pip install nixl-cu12==1.5.1 (the pdserve[nixl] "
    "extra), or use the built-in tcp transport"
)
_READ_TIMEOUT_S = 30.0
_FINISH_WAIT_S = 10.0  # a READ given up may run on this long before its peer is disconnected
_SPIN_S = 1e-3  # poll without sleeping this long: most layer READs finish within it
_HANGUP_CHECK_S = 0.01  # how often a READ under way checks that its sender still waits for it


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
        """(K, V) base addresses per layer of rank `rank`'s caches; (latent,) for MLA's."""
        k, v = (self.k_addrs, self.v_addrs) if rank == 0 else self.other_ranks[rank - 1]
        return (k, v) if v else (k,)


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
        # each tensor once: a pipeline stage's sender has its first layer's cache in place of
        # the layers it does not hold (`stage_link.stage_caches`)
        caches = list({t.data_ptr(): t for t in caches}.values())
        self._registered = [self.agent.register_memory(caches)] if caches else []
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
