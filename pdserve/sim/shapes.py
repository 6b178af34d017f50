"""The instance shapes `pdserve plan` searches: TP and EP within one node, and prefill
pipelines of such shapes across nodes (`--prefill-pp`), each with the micro-batch its prompts
are cut into."""

from __future__ import annotations

from typing import NamedTuple

from pdserve.bench.workload import Workload
from pdserve.sim.deployment import Cluster
from pdserve.sim.models import ModelSpec

TP_CHOICES = (1, 2, 4, 8)
EP_CHOICES = (2, 4, 8)  # expert parallelism over data-parallel attention (MoE only)
PP_CHOICES = (2, 4)  # prefill pipeline stages
MICRO_BATCHES = (2048, 1024, 512, 256)  # a pipeline's prefill chunks, largest first


class Shape(NamedTuple):
    """One instance's parallelism: TP, EP, pipeline stages and (with stages) the micro-batch,
    its prefill chunk in tokens."""

    tp: int
    ep: int = 1
    pp: int = 1
    chunk: int | None = None

    @property
    def devices(self) -> int:
        return max(self.tp, self.ep) * self.pp


def valid_shapes(cluster: Cluster, workload: Workload, gpu: str | None) -> list[Shape]:
    """One-node shapes on device `gpu` whose weights fit with room for at least one long
    request's KV: every TP, and for MoE models EP over TP-1 attention groups."""
    need = max(c.prompt.expected + c.output.expected for c in workload.classes)
    model, accel = cluster.model, cluster.device(gpu).accel
    shapes = [Shape(tp) for tp in TP_CHOICES if model.num_heads % tp == 0]
    if model.num_experts > 1:
        shapes += [Shape(1, ep) for ep in EP_CHOICES if model.num_experts % ep == 0]
    return [
        s
        for s in shapes
        if s.devices <= accel.max_tp
        and cluster.latency(s.tp, gpu=gpu, ep=s.ep).kv_capacity_tokens >= 2 * need
    ]


def micro_batch(prompt: int, pp: int) -> int | None:
    """The prefill chunk a `pp`-stage pipeline cuts a `prompt`-token prompt into: the largest of
    `MICRO_BATCHES` that makes >= 4 x pp micro-batches (the bubble, pp - 1 stage times, is then
    under a fifth of the prompt's time), else the smallest while it makes >= 2 x pp; None when
    the prompt is too short to fill the pipeline (a one-chunk prompt only pays the hops)."""
    for chunk in MICRO_BATCHES:
        if prompt >= 4 * pp * chunk:
            return chunk
    smallest = MICRO_BATCHES[-1]
    return smallest if prompt >= 2 * pp * smallest else None


def pipelines(model: ModelSpec, shapes: list[Shape], prompt: int, max_devices: int) -> list[Shape]:
    """Prefill pipelines of `PP_CHOICES` stages, each stage the widest of the one-node `shapes`
    (a pipeline is how an instance grows past a node; within one, TP is searched), of at most
    `max_devices` devices and `model`'s layers, micro-batched for a `prompt`-token prompt."""
    if not shapes:
        return []
    stage, out = widest(shapes), []
    for pp in PP_CHOICES:
        chunk = micro_batch(prompt, pp)
        shape = Shape(stage.tp, stage.ep, pp, chunk)
        if chunk and shape.devices <= max_devices and pp <= model.num_layers:
            out.append(shape)
    return out


def widest(shapes: list[Shape]) -> Shape:
    """The shape of the most devices (TP before EP among equals)."""
    return max(shapes, key=lambda s: (s.devices, -s.ep))
