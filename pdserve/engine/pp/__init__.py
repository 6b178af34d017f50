"""Pipeline parallelism: one engine as N stages (`--pipeline-parallel-size N`), each a process
holding consecutive layers (an even split, or `--pp-layer-partition 15,15`).

Stage 0 is the engine: its scheduler decides every step. It embeds the step's tokens, runs its
layers, and sends the step's inputs with the hidden states on to stage 1 (`Hop`), which runs
its layers and sends them to stage 2, and so on; when the step samples, the last stage sends
its hidden states back to stage 0, which applies the final norm and the head. A step that
samples nothing (a chunk of a long prompt before its last) is not waited for: stage 0 schedules
the next chunk while the later stages compute this one, so the stages overlap on one prompt.
Each stage's KV cache holds its own layers only, at the same block ids as stage 0's.

The later stages' caches live in shared memory that stage 0 maps (as a tensor-parallel group's
ranks: `engine/tp/shm.py`), so the worker's KV connectors, which run in stage 0, reach every
layer. A prefill worker pushes each stage's layers over a connection of that stage's own
(`kv_transfer/stage_senders.py`): the bytes each stage sends are exactly its layers' share.
A connector's `after_layer` for a later stage's layer runs once the step's hidden states are
back, and only for steps that sample (the prefill push's: the step that completes a prompt);
`wait_for_layer_load` for those layers runs before the step is sent on. A connector that reads
or writes blocks outside a step's hooks (the KV store link: loads, eviction copies) first
drains the pipeline (`PPGroup.drain`), since a step not waited for may still be writing them.

A stage that dies fails the engine's next exchange with `StageLost`: the worker exits and its
launcher restarts it, with every stage; the router meanwhile has the decode workers prefill
what it held. Stages run on CPU (gloo), on one host; not with tensor parallelism yet.

The parts: `stages.py` which layers each stage holds (torch-free, checked by `serve` too);
`pipe.py` a stage's messages (`PPGroup`, `Hop`, `StageLost`); `stage.py` starting the stages
(`start_pipeline`) and a stage's loop (`follow`). This package imports none of them (`serve`
checks a split with `stages.py` alone, without torch).
"""
