"""WorkerConfig: everything a worker process is started with, checked once when it is made.

A combination no worker can serve is refused here, with what to change, before any model is
loaded: the launchers (local, Ray) and `pdserve worker` build this and need no checks of their
own."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import EngineConfig
from pdserve.protocol import messages as m

KV_TRANSPORTS = ("tcp", "nixl")
KV_COMPRESSIONS = ("none", "fp8")
KV_PUSHES = ("layers", "whole")


@dataclass(frozen=True)
class WorkerConfig:
    engine: EngineConfig
    routers: tuple[str, ...]  # tcp://host:port of each router's control socket (one or more)
    worker_id: str
    kv_transport: str = "tcp"
    kv_host: str = "127.0.0.1"
    transfer_timeout_s: float = m.TRANSFER_TIMEOUT_S  # --transfer-timeout-s
    router_timeout_s: float = m.ROUTER_TIMEOUT_S  # router silence before its requests drop
    kv_store: str | None = None  # endpoint of a `pdserve store` (tcp://host:port)
    placement: tuple[tuple[str, str], ...] = ()  # reported in /health (e.g. Ray node, actor)
    kv_compression: str = "none"  # --kv-compression: fp8 on the wire (tcp only)
    kv_push: str = "layers"  # --kv-push: each layer as computed, or the whole cache at the end
    drain_timeout_s: float = m.DRAIN_TIMEOUT_S  # --drain-timeout-s: SIGTERM -> finish, exit

    def __post_init__(self) -> None:
        if not self.routers:
            raise ValueError("a worker needs a router to serve: give --router HOST:PORT")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"unknown --kv-transport {self.kv_transport!r}: choose one of {KV_TRANSPORTS}"
            )
        if self.kv_compression not in KV_COMPRESSIONS:
            raise ValueError(
                f"unknown --kv-compression {self.kv_compression!r}: choose one of {KV_COMPRESSIONS}"
            )
        check_kv_compression(self.kv_compression, self.kv_transport, self.engine.kv_cache_dtype)
        if self.kv_push not in KV_PUSHES:
            raise ValueError(f"unknown --kv-push {self.kv_push!r}: choose one of {KV_PUSHES}")
        check_tensor_parallel(self.engine.tensor_parallel_size, self.kv_store)
        for name in ("transfer_timeout_s", "router_timeout_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 0 seconds, got {getattr(self, name)}")

    @property
    def compression(self) -> str | None:
        """The sender's wire compression (None: raw blocks)."""
        return None if self.kv_compression == "none" else self.kv_compression


def check_kv_compression(compression: str, transport: str, cache_dtype: str = "auto") -> None:
    """(`pdserve serve` checks this too, before it starts any worker.)"""
    if compression != "none" and cache_dtype == "int8":
        raise ValueError(
            f"--kv-compression {compression} with --kv-cache-dtype int8: an int8 cache's blocks "
            "are already 8 bits a value on the wire; drop --kv-compression"
        )
    if compression != "none" and transport != "tcp":
        raise ValueError(
            f"--kv-compression {compression} needs --kv-transport tcp: the nixl "
            "transport moves raw blocks (the receiver reads them in place)"
        )


def check_tensor_parallel(size: int, kv_store: str | None) -> None:
    """(`pdserve serve` checks this too, before it starts any worker.)"""
    if size > 1 and kv_store:
        raise ValueError(
            "a tensor-parallel worker (size > 1) cannot use a KV store yet: the store keeps "
            "whole blocks of one rank's cache. Run it without --kv-store, or at size 1"
        )
