"""What joining a Mooncake Store pool takes besides the client (`kv_store/mooncake.py`): its
libraries (the wheel, and libibverbs/libnl kept out of the system's library path), the
`mooncake://` endpoint, this host's address as the master sees it, and the `mooncake_master`
command that `pdserve serve` starts.

`mooncake://MASTER_HOST:PORT[?replicas=N&prefer=SEGMENT&segment_mb=M&buffer_mb=B&host=ADDR
&metrics_port=P&zero_copy=1]`: `mooncake_master` at MASTER_HOST:PORT (its RPC port); each worker
contributes `segment_mb` of DRAM to the pool, the master places objects (with `replicas`
copies, preferring segment `prefer`, e.g. a decode host's `ADDR:PORT`) and evicts at its high
watermark; `buffer_mb` of staging buffers; with `metrics_port` the client's counters are
Prometheus /metrics; `zero_copy=1` registers the KV cache and loads under an engine step read
straight into it (off by default: over TCP each contiguous piece is a transfer of its own, and
a layer object's K and V halves are two pieces in the cache, so it measured slower than one
staged read and a copy: docs/serving.md).

Logs: the library at WARNING and the master without its metrics summary every 10 s, unless
`MC_LOG_LEVEL` (Mooncake's own variable, `envs.mooncake_log_level`) asks for INFO or TRACE.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from pdserve import envs

SCHEME = "mooncake://"
PARAMS = {"replicas", "prefer", "segment_mb", "buffer_mb", "host", "rank", "metrics_port",
          "zero_copy"}  # fmt: skip
MISSING_LIBRARY = (
    "the Mooncake Store client is not installed: `pip install 'pdserve[mooncake]'` (wheel "
    "mooncake-transfer-engine-non-cuda) and libibverbs.so.1 (needed even without RDMA): `make "
    "install` unpacks Debian's libibverbs1 and libnl into <venv>/sysdeps (a system-wide "
    "libibverbs1 makes NIXL's bundled UCX crash at exit)"
)


PRIVATE_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")  # load order


def private_libs() -> list[Path]:
    """libibverbs.so.1 and libnl where `make install` unpacked them (<venv>/sysdeps), in load
    order ([] if it did not): they are kept out of the system's library path, where NIXL's
    bundled UCX would load them too and crash at exit."""
    root = Path(sys.prefix, "sysdeps")
    found = {p.name: p for p in root.glob("**/lib*.so.*") if p.name in PRIVATE_LIBS}
    return [found[name] for name in PRIVATE_LIBS] if len(found) == len(PRIVATE_LIBS) else []


def _load_private_libs() -> None:
    """Load them into this process before Mooncake's modules, which then link to them."""
    for lib in private_libs():
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def import_mooncake():
    """(MooncakeDistributedStore, ReplicateConfig), or ImportError saying what to install.
    Its library logs at `envs.mooncake_log_level()` (WARNING unless `MC_LOG_LEVEL` says)."""
    os.environ[envs.MC_LOG_LEVEL] = envs.mooncake_log_level()  # read by the library: set first
    try:
        _load_private_libs()
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except (ImportError, OSError) as exc:  # the wheel, or libibverbs.so.1 under it
        raise ImportError(f"{MISSING_LIBRARY} ({exc})") from exc
    return MooncakeDistributedStore, ReplicateConfig


def parse_endpoint(endpoint: str) -> tuple[str, dict[str, str]]:
    """('HOST:PORT' of the master, {param: value}); ValueError naming what is wrong."""
    parts = urlsplit(endpoint)
    if parts.scheme != "mooncake" or not parts.hostname or not parts.port:
        raise ValueError(f"a Mooncake endpoint is mooncake://MASTER_HOST:PORT, got {endpoint!r}")
    params = {k: v[-1] for k, v in parse_qs(parts.query, strict_parsing=False).items()}
    unknown = set(params) - PARAMS
    if unknown:
        raise ValueError(
            f"unknown mooncake:// parameter(s) {sorted(unknown)}: use {sorted(PARAMS)}"
        )
    if params.get("zero_copy", "0") not in ("0", "1"):
        raise ValueError(f"mooncake:// zero_copy is 0 or 1, got {params['zero_copy']}")
    for name in ("replicas", "segment_mb", "buffer_mb", "rank", "metrics_port"):
        if name in params and not params[name].isdigit():
            raise ValueError(f"mooncake:// parameter {name} must be an integer, got {params[name]}")
    if int(params.get("replicas", 1)) < 1:
        raise ValueError("mooncake:// replicas must be >= 1")
    return f"{parts.hostname}:{parts.port}", params


def local_address(master: str) -> str:
    """The address of this host that the master's host reaches (the route to it)."""
    host, port = master.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, int(port)))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def master_command(host: str, port: int, metrics_port: int, client_ttl_s: int = 10) -> list[str]:
    """`mooncake_master` serving RPC on host:port (metrics on metrics_port), no etcd: clients
    exchange their transfer metadata peer to peer (P2PHANDSHAKE). ValueError if not installed."""
    import shutil

    exe = Path(sys.executable).with_name("mooncake_master")
    exe = str(exe) if exe.exists() else shutil.which("mooncake_master")
    if not exe:
        raise ValueError(f"mooncake_master not found: {MISSING_LIBRARY}")
    libs = sorted({str(lib.parent) for lib in private_libs()})  # the binary links them too
    path = ":".join([*libs, *envs.library_path()])
    return [
        *(["env", f"LD_LIBRARY_PATH={path}"] if libs else []),
        exe, f"--rpc_address={host}", f"--rpc_port={port}", f"--metrics_host={host}",
        f"--metrics_port={metrics_port}", f"--client_ttl={client_ttl_s}",
        "--enable_http_metadata_server=false", f"--enable_metric_reporting={_verbose()}",
    ]  # fmt: skip


def _verbose() -> str:
    """Whether `mooncake_master` logs a metrics summary every 10 s ("true" or "false"): as its
    clients' library does INFO, unless `MC_LOG_LEVEL` is WARNING or ERROR (the figures are on
    its /metrics either way). Its other lines stay: a few per client joining or leaving, and
    "Master service started", which `pdserve serve` waits for."""
    return str(envs.mooncake_log_level() not in ("WARNING", "ERROR")).lower()
