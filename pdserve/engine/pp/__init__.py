"""Pipeline parallelism: one engine as N stages (`--pipeline-parallel-size N`), each a process
holding consecutive layers (an even split, or `--pp-layer-partition 15,15`).

Stage 0 is the engine: its scheduler decides every step. It embeds the step's tokens, runs its
layers, and sends the step's inputs with the hidden states on to stage 1 (`Hop`), which runs
its layers and sends them to stage 2, and so on; when the step samples, the last stage sends
its hidden states back to stage 0, which applies the final norm and the head. A step that
samples nothing (a chunk of a long prompt before its last) is not waited for: stage 0 schedules
the next chunk while the later stages compute this one, so the stages overlap on one prompt.
Each stage's KV cache holds its own layers only, at the same block ids as stage 0's.

A prefill worker's stages each push their own layers' KV, from their own process, with a sender
of their own on their own caches (`kv_transfer/stage_link.py`): stage 0's connectors run every
layer's hooks (`wait_for_layer_load`, `after_layer`) before it sends a step on; the pushes they
queue for a later stage's layers travel down with the step (`Hop.pushes`), and that stage sends
each once it has computed the layer, so each stage's push overlaps the pipeline's next chunks
and the bytes each stage sends are exactly its layers' share. When the stages are this host's
single-rank processes, the later stages' caches also live in shared memory that stage 0 maps
(as a tensor-parallel group's ranks: `engine/kv_memory.py`), for the KV store link, which moves
whole blocks from stage 0 (refused otherwise): it reads or writes them outside a step's hooks
(loads, eviction copies), so it first drains the pipeline (`PPGroup.drain`), since a step not
waited for may still be writing them.

A stage that dies fails the engine's next exchange with `StageLost`: the worker exits and its
launcher restarts it, with every stage; the router meanwhile has the decode workers prefill
what it held. Stages run on CPU (gloo), as processes of stage 0's host, or under Ray as actors
that may span hosts (`ray_stages.py`). A stage may be a tensor-parallel group: its first rank is
the stage in the pipeline and starts the stage's other ranks (`engine/tp/`), sending them each
step with the hidden states that came down (`Step.hidden`).

The parts: `stages.py` which layers each stage holds (torch-free, checked by `serve` too);
`pipe.py` a stage's messages (`PPGroup`, `Hop`, `StageLost`); `stage.py` starting the stages
(`start_pipeline`) and a stage's loop (`follow`); `ray_stages.py` the stages as Ray actors.
This package imports none of them (`serve` checks a split with `stages.py` alone, without
torch).
"""
