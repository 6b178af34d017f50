"""KV transfer fabric: move KV cache blocks from prefill workers to decode workers, layer by layer.

Interface in `base.py`, what a cache holds in `layout.py`; backends by name through
`make_sender` / `make_receiver`: "tcp" (built in), "inproc" (one process, with fault injection
for tests), "nixl" (optional extra). Importing this package does not import torch.
"""

from pdserve.kv_transfer.base import KVReceiver, KVSender, TransferResult, TransferStats
from pdserve.kv_transfer.layout import KVLayout, KVLayoutMismatch
from pdserve.kv_transfer.registry import available_backends, make_receiver, make_sender

__all__ = [
    "KVLayout",
    "KVLayoutMismatch",
    "KVReceiver",
    "KVSender",
    "TransferResult",
    "TransferStats",
    "available_backends",
    "make_receiver",
    "make_sender",
]
