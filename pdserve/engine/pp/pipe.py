"""A stage's place in a pipeline-parallel engine and its messages over gloo: point to point,
stage s to stage s+1 (a `Hop`: the step's inputs, the hidden states after stage s's layers and
the later stages' KV pushes),
the last stage back to stage 0 (the hidden states, when the step samples), and the other
stages' KV caches as stage 0 sees them (in shared memory: `engine/kv_memory.py`).

Sends do not wait for the receiver: stage 0 sends a chunk of a prompt on and schedules the next
one while the later stages compute (the pipeline's overlap). Each pair's messages arrive in the
order they were sent, so every stage runs the steps in stage 0's order."""

from __future__ import annotations

import subprocess

import msgspec
import torch

from pdserve.engine.kv_memory import map_caches, shared_caches, zeroed_caches
from pdserve.engine.pp.stages import StagePlace
from pdserve.engine.tp.codec import Step, decode, encode
from pdserve.engine.tp.group import LOOPBACK, gloo_group, reap, spread
from pdserve.kv_transfer.stage_link import LinkAddress, LinkSpec, Push

_TAG = 0


class StageLost(RuntimeError):
    """A stage of this engine's pipeline is gone (killed, or it failed): the engine cannot
    step again. The worker exits, and its launcher restarts it with every stage."""


class Hop(msgspec.Struct):
    """One step on its way down the pipeline: rank 0's inputs (`Step`: token ids, positions,
    attention metadata), the residual stream after the previous stages' layers (T, hidden),
    and whether the last stage sends its hidden states back to stage 0 (the step samples);
    `pushes`: the KV pushes of the later stages' layers this step computes (each stage queues
    its own on its sender as it computes the layer: `kv_transfer/stage_link.py`).
    No step: a drain (`PPGroup.drain`), passed on without computing and answered; with `link`,
    the stages' KV senders' set-up (`PPGroup.open_links`)."""

    step: Step | None
    hidden: torch.Tensor
    reply: bool
    pushes: list[Push] = []
    link: LinkSpec | None = None


class PPGroup(StagePlace):
    """This process's stage and its messages. `layers[s]`: the layers stage s holds. The
    rendezvous is stage 0's `master`:`port`, this stage's pairs bind to its `address`
    (loopback for one host's stages). `shared`: the later stages' caches are in shared memory
    that stage 0 maps (its stages are this host's processes), else each stage's are its own
    alone (Ray placed them, maybe on other hosts)."""

    def __init__(
        self,
        stage: int,
        layers: list[range],
        port: int,
        procs: list[subprocess.Popen] = (),
        master: str = LOOPBACK,
        address: str = LOOPBACK,
        shared: bool = True,
    ):
        super().__init__(stage, layers)
        self.procs = list(procs)
        self.address, self.shared = address, shared
        self.restore: tuple[set[int], int] | None = None  # stage 0: its cores and threads before
        self._store, self._pg = gloo_group(stage, len(layers), port, master, address)
        self._sent: list[tuple] = []  # (works, tensors) of sends not yet known complete
        # stage 0: steps sent down and not waited for (they sample nothing) since the last reply
        self.unsettled = 0
        self.outbox: list[Push] = []  # stage 0: the later stages' pushes for the next step
        self.links: list = []  # stage 0: its `StageLink`s (a prefill worker's), for `check`

    def queue_push(self, push: Push) -> None:
        """Stage 0: send `push` with the next step down the pipeline (a `StageLink`'s)."""
        self.outbox.append(push)

    def take_pushes(self) -> list[Push]:
        pushes, self.outbox = self.outbox, []
        return pushes

    def open_links(self, spec: LinkSpec) -> list[LinkAddress]:
        """Stage 0: every later stage builds its own KV sender on its own caches (`spec`) and
        says where its control connection listens (stage 1's address first)."""
        self.send(Hop(None, torch.zeros(1), False, link=spec), 1)
        return [self.recv(s, LinkAddress) for s in range(1, self.size)]

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def send(self, obj, dst: int) -> None:
        """Send `obj` (msgspec: typed, no pickle; tensors as dtype, shape and bytes) to stage
        `dst` without waiting for it to arrive. StageLost if an earlier send failed."""
        data = encode(obj)
        size = torch.tensor([data.numel()], dtype=torch.long)
        try:
            works = [self._pg.send([size], dst, _TAG), self._pg.send([data], dst, _TAG)]
        except RuntimeError as exc:
            raise StageLost(f"pipeline stage {dst} is gone: {exc}") from None
        self._sent.append((works, size, data))  # the tensors live until their send is done
        while self._sent and all(w.is_completed() for w in self._sent[0][0]):
            self._finish(self._sent.pop(0)[0])

    def recv(self, src: int, kind):
        """The next object stage `src` sent, decoded as `kind`. StageLost if it is gone."""
        try:
            size = torch.zeros(1, dtype=torch.long)
            self._pg.recv([size], src, _TAG).wait()
            data = torch.empty(int(size), dtype=torch.uint8)
            self._pg.recv([data], src, _TAG).wait()
        except RuntimeError as exc:
            raise StageLost(f"pipeline stage {src} is gone: {exc}") from None
        return decode(data, kind)

    def flush(self) -> None:
        """Wait until every send has left (StageLost if one failed)."""
        while self._sent:
            self._finish(self._sent.pop(0)[0])

    def _finish(self, works) -> None:
        try:
            for w in works:
                w.wait()
        except RuntimeError as exc:
            raise StageLost(f"a pipeline stage is gone: {exc}") from None

    def drain(self) -> None:
        """Stage 0: return once every later stage has run every step sent to it. A step that
        samples nothing is not waited for, so its KV may still be landing in the later
        stages' caches, in blocks stage 0 may already have freed (an aborted or preempted
        prompt's): whatever reads or writes those caches outside a step's layer hooks (the KV
        store link) drains first. A round trip when steps are unsettled, else nothing."""
        if self.unsettled:
            self.send(Hop(None, torch.zeros(1), True), 1)  # (frombuffer refuses 0 bytes)
            self.recv(self.size - 1, torch.Tensor)
            self.unsettled = 0

    def check(self) -> None:
        """Stage 0: StageLost if a later stage's process has exited (an idle engine would
        otherwise notice only at its next step), or its KV push's control link is lost (every
        push of it would fail from then on)."""
        for s, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise StageLost(f"pipeline stage {s} exited (status {p.returncode})")
        for link in self.links:
            if link.lost:
                raise StageLost(f"pipeline stage {link.stage}'s KV push is lost: {link.lost}")

    def caches(self, shape: tuple[int, ...], dtype: torch.dtype, num_layers: int, per_layer=2):
        """(K caches, V caches) indexed by the model's layer number (V empty: MLA's latent).
        Collective: every stage calls it at once. Stage 0 gets every layer's: its own, and
        the later stages' mapped from their shared memory (for the KV store link, in stage 0);
        a later stage gets its own layers' and an empty tensor in place of each other layer's
        (stage 0 too, for the later layers, when the caches are not `shared`)."""
        held = len(self.held) * per_layer
        if not self.shared:
            parts = {self.stage: zeroed_caches(shape, dtype, held)}
        elif self.stage == 0:
            mine = zeroed_caches(shape, dtype, held)
            parts = {0: mine}
            for s in range(1, self.size):
                pid, fd = self.recv(s, tuple[int, int])
                parts[s] = map_caches(pid, fd, shape, dtype, len(self.layers[s]) * per_layer)
        else:
            mine, handle = shared_caches(shape, dtype, held)
            self.send(handle, 0)
            self.flush()
            parts = {self.stage: mine}
        empty = torch.empty(0, dtype=dtype)
        k, v = [empty] * num_layers, [empty] * num_layers
        for s, tensors in parts.items():
            ks, vs = spread(tensors, num_layers, self.layers[s], per_layer)
            for layer in self.layers[s]:
                k[layer] = ks[layer]
                if per_layer == 2:
                    v[layer] = vs[layer]
        return k, (v if per_layer == 2 else [])

    def close(self) -> None:
        """Stage 0: the other stages stop (None travels down the pipeline), and their
        processes are waited for."""
        if self.stage == 0 and self._pg is not None and self.size > 1:
            try:
                self.send(None, 1)
                self.flush()
            except (RuntimeError, StageLost):
                pass  # a stage is gone already
        self._pg = self._store = None
        reap(self.procs, self.restore)
        self.restore = None
