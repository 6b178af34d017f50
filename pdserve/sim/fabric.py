"""The KV transfer fabric between prefill and decode instances, as a fluid model.

Every transfer is a flow. Its rate is the least of (a) its sender's bandwidth split evenly over
the flows that sender has open, (b) the same at the receiver, and (c) while the prompt is still
being computed, the rate at which the prefill produces KV. An instance's bandwidth is its share
of the link's ports (`Link.instance_bytes_per_s`: a port per GPU on RDMA fabrics, each rank
sending its own KV heads; one per 8-GPU node on commodity Ethernet).

Layer-wise overlap: the first L-1 layers' KV stream while the prefill runs (capped by (c)); the
last layer's KV can only leave once the prefill has finished. So when a layer transfers faster
than it computes, only the last layer's transfer adds to TTFT; otherwise the backlog does too.
Simplifications: the first layer's compute time before streaming starts and per-message link
latency (microseconds) are ignored.
"""

from __future__ import annotations

from pdserve.sim.hardware import Link
from pdserve.sim.instance import Instance, SimRequest

_DONE_BYTES = 1.0  # a flow with less than a byte left is complete (float round-off)


class Flow:
    __slots__ = ("r", "src", "dst", "left", "cap", "last_layer", "computing", "rate")

    def __init__(self, r, src, dst, left, cap, last_layer):
        self.r, self.src, self.dst = r, src, dst
        self.left, self.cap, self.last_layer = left, cap, last_layer
        self.computing = True  # the prefill producing this KV has not finished
        self.rate = 0.0


class Fabric:
    """All transfers in flight; the simulator asks it for the next completion time."""

    def __init__(self, link: Link, num_layers: int) -> None:
        self.link, self.layers = link, num_layers
        self.flows: dict[int, Flow] = {}  # by request index
        self.parked: dict[int, Flow] = {}  # body sent, waiting for the prefill to finish
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

    def start(self, now: float, r: SimRequest, src: Instance, nbytes: float, compute_s: float):
        """`r`'s final prefill iteration (of `compute_s` seconds) starts now on `src`."""
        self._progress(now)
        last = nbytes / self.layers
        self.flows[r.index] = Flow(r, src, r.decoder, nbytes - last, nbytes / compute_s, last)
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
            if f.last_layer == 0.0:
                landed.append(f.r)
            elif f.computing:
                self.parked[index] = f
            else:
                self._open_last_layer(f)
        self._rerate()
        return landed
