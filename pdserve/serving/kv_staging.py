"""Pinned host blocks between a GPU KV cache and the KV transfer connectors.

The connectors move host memory: tcp sockets read and write it, NIXL registers it as DRAM, the
in-process connector copies it. A worker whose cache lives on a GPU therefore stages each
transfer through a pool of host blocks with the cache's own block shape:

* prefill: right after layer `l`'s forward pass, that layer's blocks that the step completed
  (a chunk's) are copied device -> host into the transfer's host blocks, which are then queued
  (`KVSender.send_layer`) exactly as cache blocks would be; they go back to the pool once the
  transfer is acknowledged or aborted;
* decode: the KV lands in host blocks (`KVReceiver.expect` is given them); when the prefill
  worker reports the transfer complete, all layers are copied host -> device into the
  sequence's cache blocks, before its first decode step.

The pool is sized to hold at least two prompts of the longest allowed length, so a prompt that
fits the device cache always fits the pool; a prompt that finds the pool busy waits (decode) or
is prefilled by the decode worker itself (prefill), never lost.
"""

from __future__ import annotations

import torch

from pdserve.kv_transfer.memory import layer_caches

DEFAULT_GB = 2.0


class HostStaging:
    """`num_blocks` host blocks shaped like `k_caches`/`v_caches`' (one K and one V tensor per
    layer, `[num_blocks, block_size, num_kv_heads, head_dim]`; an MLA latent and no V), lent
    per transfer id.

    `k_caches`/`v_caches` are the connectors' caches; `device_k`/`device_v` the engine's."""

    def __init__(self, device_k, device_v, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"host staging needs at least one block, got {num_blocks}")
        self.device_k, self.device_v = device_k, device_v
        self.device = device_k[0].device
        pin = self.device.type == "cuda"  # page-locked: the copies run at the link's speed
        shape = (num_blocks, *device_k[0].shape[1:])
        dtype = device_k[0].dtype
        self.k_caches = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in device_k]
        self.v_caches = [torch.zeros(shape, dtype=dtype, pin_memory=pin) for _ in device_v]
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))
        self._held: dict[str, list[int]] = {}
        # per transfer: the (first, count) of its host blocks last copied, their device block
        # index and host blocks (built at a chunk's first layer, used by its other layers)
        self._index: dict[str, tuple[tuple[int, int], tuple[torch.Tensor, slice | torch.Tensor]]]
        self._index = {}

    @classmethod
    def sized(cls, device_k, device_v, max_model_len: int, gb: float = DEFAULT_GB) -> HostStaging:
        """`gb` GiB of blocks, but room for at least two prompts of `max_model_len` tokens, and
        never more blocks than the device cache has."""
        block_size = device_k[0].shape[1]
        block_bytes = sum(t[0].nbytes for t in (*device_k, *device_v))
        floor = 2 * -(-max_model_len // block_size)
        n = max(int(gb * (1 << 30)) // block_bytes, floor)
        return cls(device_k, device_v, min(n, device_k[0].shape[0]))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, transfer_id: str, n: int) -> list[int] | None:
        """Lend `n` host blocks to `transfer_id`, one contiguous run if the pool has one (the
        copies then move one slice per layer); None (nothing taken) if fewer are free."""
        if transfer_id in self._held:
            raise ValueError(f"transfer {transfer_id!r} already holds host blocks")
        if n > len(self._free):
            return None
        free = sorted(self._free)
        start = next((i for i in range(len(free) - n + 1) if free[i + n - 1] - free[i] == n - 1), 0)
        ids = free[start : start + n]
        self._free = free[:start] + free[start + n :]
        self._held[transfer_id] = ids
        return ids

    def release(self, transfer_id: str) -> None:
        """Return `transfer_id`'s host blocks to the pool (no-op if it holds none)."""
        self._free.extend(self._held.pop(transfer_id, []))
        self._index.pop(transfer_id, None)

    def held(self, transfer_id: str) -> list[int]:
        return self._held[transfer_id]

    def to_host(
        self, transfer_id: str, layer: int, device_ids: list[int], at: int = 0
    ) -> list[int]:
        """Copy layer `layer` of cache blocks `device_ids` into the transfer's host blocks from
        its `at`-th on (a chunk's blocks, as each chunk of a prompt is computed); returns
        those host blocks."""
        src, host = self._indexes(transfer_id, device_ids, at)
        pairs = zip(
            layer_caches(self.device_k, self.device_v, layer),
            layer_caches(self.k_caches, self.v_caches, layer),
            strict=True,
        )  # K and V, or an MLA latent alone
        for dev, stage in pairs:
            gathered = dev.index_select(0, src)
            if isinstance(host, slice):  # straight into the pinned run, at the link's speed
                stage[host].copy_(gathered)
            else:
                stage.index_copy_(0, host, gathered.cpu())
        return self._held[transfer_id][at : at + len(device_ids)]

    def to_device(self, transfer_id: str, device_ids: list[int]) -> None:
        """Copy every layer of the transfer's host blocks into cache blocks `device_ids`."""
        if len(held := self._held[transfer_id]) != len(device_ids):
            raise ValueError(
                f"transfer {transfer_id!r} holds {len(held)} host blocks, not {len(device_ids)}"
            )
        dst, host = self._indexes(transfer_id, device_ids)
        pinned = isinstance(host, slice) and self.device.type == "cuda"  # copies can queue up
        for dev, stage in ((self.device_k, self.k_caches), (self.device_v, self.v_caches)):
            for layer, cache in enumerate(dev):
                cache.index_copy_(0, dst, stage[layer][host].to(self.device, non_blocking=pinned))
        if pinned:  # the host blocks are lent again once this returns
            torch.cuda.current_stream(self.device).synchronize()

    def _indexes(
        self, transfer_id: str, device_ids: list[int], at: int = 0
    ) -> tuple[torch.Tensor, slice | torch.Tensor]:
        """(`device_ids` as an index on the device, the transfer's host blocks from its `at`-th:
        a slice if they are one run, else an index tensor), built once per transfer and chunk:
        a prompt's blocks are the same for each of its layers."""
        held = self._held[transfer_id][at : at + len(device_ids)]
        if len(held) != len(device_ids):
            raise ValueError(
                f"transfer {transfer_id!r} holds {len(self._held[transfer_id])} host blocks, "
                f"not {at} + {len(device_ids)}"
            )
        cached = self._index.get(transfer_id)
        if cached is not None and cached[0] == (at, len(held)):
            return cached[1]
        one_run = held and held[-1] - held[0] == len(held) - 1
        host = slice(held[0], held[-1] + 1) if one_run else torch.tensor(held, dtype=torch.long)
        device = torch.tensor(device_ids, dtype=torch.long, device=self.device)
        self._index[transfer_id] = (at, len(held)), (device, host)
        return device, host

    def check(self) -> None:
        """Every host block is either free or lent to exactly one transfer."""
        lent = [b for ids in self._held.values() for b in ids]
        assert sorted(lent + self._free) == list(range(self.num_blocks)), "host staging leaked"
