"""The KV transfer fabric between prefill and decode instances, as a fluid model.

Every transfer is a flow. Its rate is the least of (a) its sender's bandwidth split evenly over
the flows that sender has open, (b) the same at the receiver, and (c) while the prompt is still
being computed, the rate at which the prefill produces KV. An instance's bandwidth is its share
of the link's ports (`Link.instance_bytes_per_s`: a port per GPU on RDMA fabrics, each rank
sending its own KV heads; one per 8-GPU node on commodity Ethernet).

Layer-wise overlap, as a prefill worker pushes (`serving/prefill_side.py`): each prefill
iteration (chunk) of a prompt makes its KV available while it runs, at the rate it computes it,
beside what earlier chunks left unsent; the last layer of the last chunk can only leave once
the prefill has finished. So when a layer transfers faster than it computes, only the last
layer's transfer adds to TTFT; otherwise the backlog does too. Simplifications: within an
iteration, the backlog and the new KV are made available evenly over it (so each iteration's KV
is out by its end on a fast link), a chunk's own last layer is not held back, a pipeline's later
stages (which push only once the prompt is computed) stream as stage 0 does, and the first
layer's compute time and per-message link latency (microseconds) are ignored.
"""

from __future__ import annotations

from pdserve.sim.hardware import Link
from pdserve.sim.instance import Instance, SimRequest

_DONE_BYTES = 1.0  # a flow with less than a byte left is complete (float round-off)


class Flow:
    __slots__ = ("r", "src", "dst", "left", "cap", "last_layer", "computing", "final", "rate")

    def __init__(self, r, src, dst):
        self.r, self.src, self.dst = r, src, dst
        self.left, self.cap, self.last_layer = 0.0, 0.0, 0.0
        self.computing = True  # the prefill producing this KV has not finished
        self.final = False  # its last iteration has started: no more KV comes after
        self.rate = 0.0


class Fabric:
    """All transfers in flight; the simulator asks it for the next completion time."""

    def __init__(self, link: Link, num_layers: int) -> None:
        self.link, self.layers = link, num_layers
        self.flows: dict[int, Flow] = {}  # by request index
        self.parked: dict[int, Flow] = {}  # body sent, waiting for the prefill to finish
        self.between: dict[int, Flow] = {}  # all sent so far, waiting for the next chunk
        self.now = 0.0
        self.bytes_sent = 0.0

    def _progress(self, now: float) -> None:
        dt = now - self.now
        if dt > 0:
            for f in self.flows.values():
                f.left -= f.rate * dt
                self.bytes_sent += f.rate * dt
        self.now = now

    def _rerate(self) -> None:
        count: dict[Instance, int] = {}
        for f in self.flows.values():
            count[f.src] = count.get(f.src, 0) + 1
            count[f.dst] = count.get(f.dst, 0) + 1
        for f in self.flows.values():
            f.rate = min(f.cap, f.src.link_bw / count[f.src], f.dst.link_bw / count[f.dst])

    def chunk(
        self, now: float, r: SimRequest, src: Instance, nbytes: float, compute_s: float,
        final: bool,
    ) -> None:  # fmt: skip
        """A prefill iteration of `r` (of `compute_s` seconds, making `nbytes` of its KV; its
        last one when `final`) starts now on `src`."""
        self._progress(now)
        f = self.flows.pop(r.index, None) or self.between.pop(r.index, None)
        f = f or Flow(r, src, r.decoder)
        last = nbytes / self.layers if final else 0.0
        f.left += nbytes - last
        f.last_layer, f.final, f.computing = last, final, True
        f.cap = f.left / compute_s
        self.flows[r.index] = f
        self._rerate()

    def chunk_done(self, now: float, r: SimRequest) -> None:
        """A prefill iteration of `r` that was not its last ended: its KV so far is all made,
        so only the link limits it until the next one starts."""
        self._progress(now)
        if (f := self.flows.get(r.index)) is not None:
            f.cap = float("inf")
            self._rerate()

    def prefill_done(self, now: float, r: SimRequest) -> None:
        """`r`'s prefill finished: its last layer may leave, and production no longer caps."""
        self._progress(now)
        parked = self.parked.pop(r.index, None)
        flow = parked or self.flows[r.index]
        flow.computing, flow.cap = False, float("inf")
        if parked is not None:
            self._open_last_layer(parked)
        self._rerate()

    def _open_last_layer(self, f: Flow) -> None:
        f.left, f.last_layer = f.last_layer, 0.0
        self.flows[f.r.index] = f

    def next_time(self) -> float | None:
        """When the next flow (or stage of one) completes, if any is in flight."""
        times = [self.now + max(f.left, 0.0) / f.rate for f in self.flows.values() if f.rate > 0]
        return min(times) if times else None

    def complete(self, now: float) -> list[SimRequest]:
        """Advance to `now`; return requests whose KV has fully landed."""
        self._progress(now)
        landed = []
        for index, f in list(self.flows.items()):
            if f.left > _DONE_BYTES:
                continue
            del self.flows[index]
            if not f.final:  # what its chunks made so far is through; more comes
                f.left, f.rate = 0.0, 0.0
                self.between[index] = f
            elif f.last_layer == 0.0:
                landed.append(f.r)
            elif f.computing:
                self.parked[index] = f
            else:
                self._open_last_layer(f)
        self._rerate()
        return landed
