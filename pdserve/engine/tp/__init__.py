"""Tensor parallelism: one engine as N ranks (`--tensor-parallel-size N`), Megatron-style.

Each rank holds a slice of every layer: its share of the query heads and of the KV heads (q/k/v
split by rows, the output projection by columns), and of the MLP's intermediate columns
(gate/up by rows, down by columns); one all-reduce after the attention's output projection and
one after the MLP add the ranks' partial sums. Embeddings, norms and the LM head are whole on
every rank. Each rank's KV cache holds its own KV heads, at the same block ids as rank 0's.

Rank 0 is the engine: its scheduler decides every step, and it sends the step's inputs (token
ids, positions, attention metadata with the block tables) to the other ranks (`broadcast`),
which run the same forward pass (`follow`) and sample nothing. At start rank 0 starts the other
ranks as processes (`python -m pdserve.engine.tp`: `rank.py`), which die with it, each pinned
to its share of rank 0's cores, and sends them the engine config and the model's weights (so a
model built in memory, as tests do, needs no file). Collectives use gloo on CPU.

The other ranks' KV caches live in shared memory (`shm.shared_caches`: a memfd each, which rank 0
maps through /proc/PID/fd): the worker's KV connectors run in rank 0's process and move every
rank's heads (a prefill group's sender reads them all; a decode group has one receiver per
rank, each writing its rank's cache). Rank 0 pushes a layer once its forward pass is over: the
all-reduce after the layer's MLP has then waited for every rank, so all their KV is written.

KV heads that do not divide by N are replicated when N is a multiple of their count (as vLLM
does: ranks r*k .. r*k+k-1 share head r); other splits are refused with the reason.

The parts, one job each: `shard.py` which slice of the model a rank holds (`TPShard`);
`group.py` a rank's place in the group and its collectives (`TPGroup`); `codec.py` what
travels between the ranks (`Step`, `Start`: msgspec, tensors as bytes); `shm.py` the KV caches
in shared memory; `rank.py` starting the ranks (`start_group`) and a rank's loop (`follow`).
"""

from __future__ import annotations

from pdserve.engine.tp.group import TPGroup
from pdserve.engine.tp.rank import start_group
from pdserve.engine.tp.shard import TPShard

__all__ = ["TPGroup", "TPShard", "start_group"]
