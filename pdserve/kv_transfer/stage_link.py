"""A pipeline stage's own KV push, driven from stage 0.

Stage s > 0 of a pipeline-parallel prefill worker holds its layers' KV cache in its own process,
so it pushes those layers itself: its own sender (tcp or nixl) on its own caches, with its own
connections, on its own host's link (`StageLinkServer`). Stage 0 decides what is pushed, as for
its own layers: the prefill side's `send_layer` calls for stage s's layers go to a `StageLink`
(a `KVSender` in stage 0), which only records them; the runner sends them down the pipeline with
the step that computes those layers (`Hop.pushes`), and stage s queues each on its sender once
it has computed that layer. Nothing of stage s's cache crosses into stage 0.

The rest is a control connection, stage 0 -> stage s (TCP, opened at start-up with a one-time
token that stage s sent to stage 0 over the pipeline's gloo pair: only stage 0 gets in):

    stage 0 -> Seal(tid)          every push of tid has been queued (stage 0 asks only once the
                                  step that completes the prompt came back from the last stage,
                                  so stage s has queued them all); report when it has ended
    stage 0 -> Cancel(tid, why)   fail tid; stage s drops any push of it still on its way down
                                  the pipeline, and answers once its sender no longer reads it
    stage 0 -> CloseEndpoint(ep)  drop the connections to a receiver that stopped answering
    stage s -> Ended(tid, ...)    tid ended on stage s (after a Seal or a Cancel), with its
                                  sender's counters

A control connection that breaks fails every transfer still open on it ("pipeline stage s is
gone"), and the pipeline's next check (`PPGroup.check`, each heartbeat) fails with `StageLost`:
the worker exits and is restarted with its stages.
"""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from pdserve.kv_transfer.base import KVSender, TransferResult, TransferStats
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.memory import check_layer_blocks
from pdserve.kv_transfer.wire import recv_exact, shutdown_socket

log = logging.getLogger("pdserve.kv_transfer")

_LEN = struct.Struct("!I")
CANCEL_TIMEOUT_S = 30.0  # a stage that does not answer a cancel by then is taken for gone
_FORGET = 4096  # cancelled transfer ids a stage remembers (pushes of them may still come)


class Push(msgspec.Struct, array_like=True, frozen=True):
    """One `send_layer` of a later stage's layer, travelling down the pipeline with its step.
    `epoch`: how many times stage 0 cancelled this transfer id before (a cancelled request's id
    may come again: only the pushes of the cancelled attempt are dropped)."""

    layer: int
    endpoint: str
    transfer_id: str
    src: list[int]
    dst: list[int]
    epoch: int = 0


class LinkSpec(msgspec.Struct, frozen=True):
    """What a stage builds its sender from (sent down the pipeline by stage 0 at start-up)."""

    transport: str
    layout: KVLayout  # the prefill worker's
    compression: str | None


class LinkAddress(msgspec.Struct, frozen=True):
    """Where stage s listens for stage 0's control connection, and the token it must send."""

    host: str
    port: int
    token: bytes


class Seal(msgspec.Struct, tag="seal", frozen=True):
    transfer_id: str


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    transfer_id: str
    reason: str
    epoch: int = 0  # the attempt cancelled (Push.epoch)


class CloseEndpoint(msgspec.Struct, tag="close_endpoint", frozen=True):
    endpoint: str


class Ended(msgspec.Struct, tag="ended", frozen=True):
    transfer_id: str
    ok: bool
    bytes_sent: int
    seconds: float
    error: str | None
    stats: TransferStats


_encoder = msgspec.msgpack.Encoder()
_to_stage = msgspec.msgpack.Decoder(Seal | Cancel | CloseEndpoint)
_to_zero = msgspec.msgpack.Decoder(Ended)


def _send(sock: socket.socket, lock: threading.Lock, msg) -> None:
    data = _encoder.encode(msg)
    with lock:
        sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket, decoder):
    return decoder.decode(recv_exact(sock, _LEN.unpack(recv_exact(sock, _LEN.size))[0]))


def _failed(error: str) -> TransferResult:
    return TransferResult(False, 0, 0.0, error)


class StageLink(KVSender):
    """Stage 0's handle on stage `stage`'s sender: `send_layer` records the push for the next
    step down the pipeline (`queue`), its block ids checked now (`num_blocks`: every stage's
    cache has as many as stage 0's), as any sender's are; the rest goes over the control
    connection."""

    def __init__(
        self, stage: int, address: LinkAddress, queue: Callable[[Push], None], num_blocks: int
    ) -> None:
        self.stage, self._queue, self.num_blocks = stage, queue, num_blocks
        self._sock = socket.create_connection((address.host, address.port), timeout=10)
        self._sock.settimeout(None)
        self._sock.sendall(address.token)
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._ended: dict[str, TransferResult] = {}
        self._sealed: set[str] = set()
        self._stats = TransferStats()
        self._gone: str | None = None  # why the control connection is lost
        self._closing = False
        self._epochs: OrderedDict[str, int] = OrderedDict()  # ids cancelled: their next attempt
        self._reader = threading.Thread(target=self._read, name=f"stage-link {stage}", daemon=True)
        self._reader.start()

    def send_layer(self, dest_endpoint, transfer_id, layer, src_block_ids, dst_block_ids) -> None:
        check_layer_blocks(src_block_ids, dst_block_ids, self.num_blocks)
        self._queue(Push(layer, dest_endpoint, transfer_id, list(src_block_ids),
                         list(dst_block_ids), self._epochs.get(transfer_id, 0)))  # fmt: skip

    def settled(self, transfer_id: str) -> bool:
        with self._cond:
            if transfer_id in self._ended or self._gone:
                return True
            first = transfer_id not in self._sealed
            self._sealed.add(transfer_id)
        if first:
            self._command(Seal(transfer_id))
        return False

    def wait(self, transfer_id: str, timeout_s: float) -> TransferResult:
        if not self.settled(transfer_id):
            with self._cond:
                self._cond.wait_for(lambda: self._over(transfer_id), timeout_s)
        with self._cond:
            if self._over(transfer_id):
                return self._take(transfer_id)
        return self.cancel(transfer_id, f"timed out after {timeout_s:g} s")

    def wait_change(self, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait(timeout_s)

    def cancel(self, transfer_id: str, reason: str) -> TransferResult:
        with self._cond:
            if self._over(transfer_id):
                return self._take(transfer_id)
            self._sealed.add(transfer_id)
            epoch = self._epochs.pop(transfer_id, 0)
            self._epochs[transfer_id] = epoch + 1  # pushes of this id from now on: a new attempt
            while len(self._epochs) > _FORGET:
                self._epochs.popitem(last=False)
        self._command(Cancel(transfer_id, reason, epoch))
        with self._cond:
            if not self._cond.wait_for(lambda: self._over(transfer_id), CANCEL_TIMEOUT_S):
                self._lose(f"it did not answer a cancel within {CANCEL_TIMEOUT_S:g} s")
            return self._take(transfer_id)

    def close_endpoint(self, endpoint: str) -> None:
        self._command(CloseEndpoint(endpoint))

    @property
    def lost(self) -> str | None:
        """Why the control connection is lost (None while it works, or once closed)."""
        return None if self._closing else self._gone

    def stats(self) -> TransferStats:
        """Stage s's sender's counters, as of its last report (each transfer's end)."""
        with self._cond:
            return self._stats

    def close(self) -> None:
        self._closing = True
        shutdown_socket(self._sock)
        self._reader.join(timeout=5)
        self._sock.close()

    # -- internals -------------------------------------------------------------------------
    def _over(self, transfer_id: str) -> bool:
        return transfer_id in self._ended or self._gone is not None

    def _take(self, transfer_id: str) -> TransferResult:
        """The ended transfer's result, forgotten (caller holds the condition)."""
        self._sealed.discard(transfer_id)
        result = self._ended.pop(transfer_id, None)
        return result or _failed(f"pipeline stage {self.stage} is gone: {self._gone}")

    def _command(self, msg) -> None:
        try:
            _send(self._sock, self._send_lock, msg)
        except OSError as exc:
            with self._cond:
                self._lose(f"its control connection failed: {exc}")

    def _lose(self, why: str) -> None:
        """Every open transfer fails (caller holds the condition)."""
        if self._gone is None:
            self._gone = why
            if not self._closing:
                log.warning("pipeline stage %d's KV push is lost: %s", self.stage, why)
        self._cond.notify_all()

    def _read(self) -> None:
        try:
            while True:
                msg = _recv(self._sock, _to_zero)
                with self._cond:
                    self._stats = msg.stats
                    if msg.transfer_id in self._sealed:  # (not a late second answer)
                        self._ended[msg.transfer_id] = TransferResult(
                            msg.ok, msg.bytes_sent, msg.seconds, msg.error
                        )
                    self._cond.notify_all()
        except (OSError, ConnectionError, msgspec.DecodeError) as exc:
            with self._cond:
                self._lose(f"its control connection closed ({exc})")


class StageLinkServer:
    """Stage s's side: its sender on its own caches, the pushes that come down the pipeline
    (`push`, called as each layer is computed), and stage 0's control connection."""

    def __init__(self, sender: KVSender, host: str) -> None:
        self.sender = sender
        self._listener = socket.create_server((host, 0))
        self.address = LinkAddress(host, self._listener.getsockname()[1], secrets.token_bytes(16))
        self._lock = threading.Lock()  # a push vs a cancel of its transfer
        self._cancelled: OrderedDict[tuple[str, int], None] = OrderedDict()  # (id, epoch)
        self._sealed: set[str] = set()
        self._cond = threading.Condition()
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._serve, name="stage-link control", daemon=True),
            threading.Thread(target=self._report, name="stage-link report", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def push(self, pushes: Sequence[Push]) -> None:
        """Queue these pushes (of a layer just computed) on this stage's sender; those of a
        cancelled transfer are dropped."""
        with self._lock:
            for p in pushes:
                if (p.transfer_id, p.epoch) not in self._cancelled:
                    self.sender.send_layer(p.endpoint, p.transfer_id, p.layer, p.src, p.dst)

    def close(self) -> None:
        with self._send_lock:  # against a connection being accepted now
            self._stop.set()
        with self._cond:
            self._cond.notify_all()
        shutdown_socket(self._listener)  # wakes a thread still waiting in accept
        self._listener.close()
        self._break()
        for t in self._threads:
            t.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        self.sender.close()

    def _serve(self) -> None:
        """Accept stage 0 (the first connection that sends the token), then its commands."""
        try:
            while True:
                sock, _ = self._listener.accept()
                sock.settimeout(10)
                try:
                    token = bytes(recv_exact(sock, len(self.address.token)))
                except (OSError, ConnectionError):
                    token = b""
                if secrets.compare_digest(token, self.address.token):
                    break
                sock.close()
            sock.settimeout(None)
            self._listener.close()
            with self._send_lock:
                if self._stop.is_set():  # closed while it connected
                    sock.close()
                    return
                self._sock = sock
            while True:
                self._command(_recv(sock, _to_stage))
        except (OSError, ConnectionError, msgspec.DecodeError) as exc:
            # stage 0 closed it (it stops), or is gone: its pipeline tells this stage to exit
            log.info("pipeline stage link: stage 0's control connection closed (%s)", exc)
        except Exception:  # a command failed: break the link, so that stage 0 sees it lost
            log.exception("pipeline stage link: a command from stage 0 failed")
            self._break()

    def _command(self, msg) -> None:
        if isinstance(msg, Seal):
            with self._cond:
                self._sealed.add(msg.transfer_id)
                self._cond.notify_all()
        elif isinstance(msg, Cancel):
            with self._lock:
                self._cancelled[(msg.transfer_id, msg.epoch)] = None
                while len(self._cancelled) > _FORGET:
                    self._cancelled.popitem(last=False)
                with self._cond:
                    self._sealed.discard(msg.transfer_id)
                result = self.sender.cancel(msg.transfer_id, msg.reason)
            self._ended(msg.transfer_id, result)
        else:
            self.sender.close_endpoint(msg.endpoint)

    def _report(self) -> None:
        """Answer each sealed transfer once it has ended on this stage's sender."""
        try:
            self._report_loop()
        except Exception:  # break the link, so that stage 0 sees it lost
            log.exception("pipeline stage link: reporting to stage 0 failed")
            self._break()

    def _break(self) -> None:
        if self._sock is not None:
            shutdown_socket(self._sock)

    def _report_loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                if not self._sealed:
                    self._cond.wait(0.5)
                    continue
                sealed = list(self._sealed)
            done = [t for t in sealed if self.sender.settled(t)]
            if not done:
                self.sender.wait_change(0.05)
                continue
            with self._lock:  # against a cancel: one answer per transfer
                with self._cond:
                    done = [t for t in done if t in self._sealed]
                    self._sealed.difference_update(done)
                results = [(tid, self.sender.wait(tid, 0.0)) for tid in done]
            for tid, result in results:
                self._ended(tid, result)

    def _ended(self, tid: str, result: TransferResult) -> None:
        msg = Ended(tid, result.ok, result.bytes_sent, result.seconds, result.error,
                    self.sender.stats())  # fmt: skip
        try:
            _send(self._sock, self._send_lock, msg)
        except (OSError, AttributeError) as exc:
            log.warning("pipeline stage link: cannot report transfer %s to stage 0: %s", tid, exc)


def stage_caches(k_caches: Sequence, v_caches: Sequence, held: range) -> tuple[list, list]:
    """A stage's (K, V) caches as a sender takes them, one per layer: its own layers', and in
    place of each other layer's (not in this process, or not this stage's to send) its first
    layer's, which it never sends for them. V empty: a latent cache."""

    def per_layer(caches: Sequence) -> list:
        return [caches[i] if i in held else caches[held.start] for i in range(len(caches))]

    return per_layer(k_caches), per_layer(v_caches) if v_caches else []
