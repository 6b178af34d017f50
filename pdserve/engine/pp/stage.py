"""The stages of a pipeline-parallel engine as processes: stage 0 (the engine) starts stages
1 .. N-1 (`python -m pdserve.engine.pp`, pinned and dying with it, as tensor-parallel ranks are:
`engine/tp/rank.py` `spawn_ranks`) and sends each the model's config and its own layers'
weights (`start_pipeline`); each then runs its layers over every `Hop` that reaches it and
passes the result on (`follow`) until None comes."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from pdserve.engine.pp.pipe import Hop, PPGroup, StageLost
from pdserve.engine.pp.ray_stages import ray_placement, spawn_ray_stages
from pdserve.engine.pp.stages import stage_layers, stage_weights
from pdserve.engine.tp.codec import Start
from pdserve.engine.tp.rank import rank_main, spawn_ranks

log = logging.getLogger("pdserve.engine.pp")


def start_pipeline(config, files, max_model_len: int) -> PPGroup:
    """Stage 0: check the split, start stages 1 .. N-1, join them, send each its part."""
    from pdserve.engine.model_runner import resolve_device

    layers = stage_layers(
        files.config.num_layers, config.pipeline_parallel_size, config.pp_layer_partition
    )
    if resolve_device(config.device).type != "cpu":
        raise ValueError(
            "--pipeline-parallel-size > 1 runs on CPU stages (gloo) for now; on a GPU use "
            "--pipeline-parallel-size 1"
        )
    placed = ray_placement(len(layers))
    if placed is not None:  # a Ray actor: the stages go to its placement group's bundles
        group = spawn_ray_stages(placed, layers, config.num_threads, follow)
    else:
        spawned = spawn_ranks("pdserve.engine.pp", len(layers), config.num_threads)
        group = PPGroup(0, layers, spawned.port, spawned.procs)
        group.restore = spawned.pin_self()
    path = str(files.path) if files.path is not None else None
    for s in range(1, len(layers)):
        part = stage_weights(files.weights, layers[s], first=False)
        group.send(Start(config, files.config, part, files.fingerprint, path, max_model_len), s)
    group.flush()
    return group


def follow(stage: int, size: int, port: int, threads: int, **where) -> None:
    """Stages 1 .. N-1: build this stage's layers, then run every step that comes down the
    pipeline until None comes (passed on, so that the next stage stops too). `where`: the
    group's addresses and whether its caches are shared (`PPGroup`; one host's by default)."""
    from pdserve.engine.model_runner import ModelRunner

    torch.set_num_threads(threads)
    group = PPGroup(stage, [range(0)] * size, port, **where)
    start = group.recv(0, Start)
    config = replace(start.config, num_threads=threads)
    group.layers = stage_layers(  # as stage 0 split them (it checked the split)
        start.model.num_layers, config.pipeline_parallel_size, config.pp_layer_partition
    )
    files, tp = start.files(), None
    if config.tensor_parallel_size > 1:  # this stage is a tensor-parallel group: its ranks
        from pdserve.engine.tp import start_group

        tp = start_group(config, files, start.max_model_len, stage)
    runner = ModelRunner(config, files, start.max_model_len, tp=tp, pp=group)
    del start, files
    link = None  # this stage's KV sender, once stage 0 asks for it (a prefill worker's)
    try:
        while (hop := group.recv(stage - 1, Hop | None)) is not None:
            hidden = hop.hidden  # no step: a drain, or the senders' set-up
            if hop.link is not None:
                link = open_link(group, runner, hop.link)
            elif hop.step is not None:
                hidden = runner.run_stage(hop, push_hook(link, hop.pushes))
            if not group.is_last:
                group.send(Hop(hop.step, hidden, hop.reply, hop.pushes, hop.link), stage + 1)
            elif hop.reply:
                group.send(hidden, 0)
        if not group.is_last:
            group.send(None, stage + 1)
        group.flush()
    except StageLost as exc:  # stage 0 went away (it exited, or was killed), or a neighbour
        log.warning("pipeline stage %d: %s; exiting", stage, exc)
    finally:
        if link is not None:
            link.close()
        if tp is not None:
            tp.close()


def open_link(group: PPGroup, runner, spec):
    """This stage's KV sender on its own caches (`StageLinkServer`), its control address sent
    to stage 0. It listens where the pipeline's gloo pairs do (`PPGroup.address`)."""
    from pdserve.kv_transfer import make_sender
    from pdserve.kv_transfer.stage_link import StageLinkServer, stage_caches

    ranks = [stage_caches(k, v, group.held) for k, v in runner.rank_caches]
    group_ranks = {"ranks": ranks} if len(ranks) > 1 else {}  # a stage of several TP ranks
    sender = make_sender(spec.transport, spec.layout, *ranks[0], compression=spec.compression,
                         **group_ranks)  # fmt: skip
    server = StageLinkServer(sender, group.address)
    group.send(server.address, 0)
    group.flush()
    return server


def push_hook(link, pushes):
    """The layer hook that queues this stage's pushes of layer i once it is computed."""
    if link is None or not pushes:
        return None
    by_layer: dict[int, list] = {}
    for p in pushes:
        by_layer.setdefault(p.layer, []).append(p)
    return lambda i: link.push(by_layer.get(i, ()))


def main() -> None:
    rank_main("python -m pdserve.engine.pp", "one stage of a pipeline-parallel engine", follow)
