"""Connectors by name, imported only when asked for (nixl is an optional extra)."""

from __future__ import annotations

import importlib

from pdserve.kv_transfer.base import KVReceiver, KVSender
from pdserve.kv_transfer.layout import KVLayout

# name -> (module, sender class, receiver class)
_BACKENDS = {
    "tcp": ("pdserve.kv_transfer.tcp", "TcpSender", "TcpReceiver"),
    "inproc": ("pdserve.kv_transfer.inproc", "InprocSender", "InprocReceiver"),
    "nixl": ("pdserve.kv_transfer.nixl", "NixlSender", "NixlReceiver"),
}


# The connectors that move KV between processes and hosts (inproc is for tests), and the
# transports the KV store serves block bytes over: the choices of every --kv-transport/--transport.
TRANSPORTS = ("tcp", "nixl")


def available_backends() -> list[str]:
    """Every connector name `make_sender`/`make_receiver` accept (nixl may still fail to import)."""
    return list(_BACKENDS)


def _load(name: str, index: int):
    if name not in _BACKENDS:
        raise ValueError(f"unknown KV transfer backend {name!r}; available: {', '.join(_BACKENDS)}")
    module = importlib.import_module(_BACKENDS[name][0])
    return getattr(module, _BACKENDS[name][index])


def make_sender(name: str, layout: KVLayout, k_caches, v_caches, **options) -> KVSender:
    """A sender of backend `name`; `options` go to its constructor (e.g. secret=...)."""
    return _load(name, 1)(layout, k_caches, v_caches, **options)


def make_receiver(
    name: str, layout: KVLayout, k_caches, v_caches, host: str = "127.0.0.1", **options
) -> KVReceiver:
    """A receiver of backend `name` bound on `host`; call `.start()` before handing out
    `.endpoint`."""
    return _load(name, 2)(layout, k_caches, v_caches, host, **options)
