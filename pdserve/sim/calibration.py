"""This machine as a simulator target: measured peak FLOP/s and memory bandwidth, the profile JSON,
and a cluster's speeds fitted to what serving workers measure (`calibrated`, for the autoscaler).

A profile file holds the measured CPU "hardware" entry, the engine model's shape and dtype, the
raw timings and the fitted `Efficiency`, and optionally ("serving", added by `save_overhead`)
the serving path's overhead per mode; `load_profile` turns it back into what the simulator
needs (an `Accelerator`, a `ModelSpec`, an `Efficiency`, the weight dtype, the overheads).
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, NamedTuple

from pdserve.sim.deployment import Cluster, ServingOverhead
from pdserve.sim.hardware import Accelerator, Link
from pdserve.sim.kvmath import kv_dtype_of
from pdserve.sim.latency import Batch, Efficiency
from pdserve.sim.models import ModelSpec
from pdserve.sim.overhead import OverheadFit
from pdserve.sim.profile import PROFILE_VERSION, Fit, Point


def measure_cpu(
    threads: int | None = None, repeats: int = 3, dtype: str = "float32"
) -> dict[str, Any]:
    """Peak matmul FLOP/s in `dtype` (the engine's: a bfloat16 engine on a CPU with
    AVX512-BF16 runs its GEMMs ~2x faster than float32, and fitting it against the float32 peak
    would pin the fitted efficiency at 1) and copy bandwidth of this machine, with torch."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    n = 1024
    a = torch.randn(n, n).to(getattr(torch, dtype))
    b = torch.randn(n, n).to(getattr(torch, dtype))
    torch.mm(a, b)  # warm-up
    mm = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    src = torch.empty(32 * 1024 * 1024)  # 128 MiB, far beyond any cache
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return {
        "name": "cpu",
        "description": f"{_cpu_model()}, {torch.get_num_threads()} threads, {dtype} (measured)",
        "peak_flops": 2 * n**3 / mm,
        "mem_bytes_per_s": 2 * src.numel() * 4 / copy,  # read + write
        "mem_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "loopback_bytes_per_s": measure_loopback(),
        "tp_link": "pcie-gen4",
        "max_tp": 1,
    }


def measure_loopback(total: int = 128 * 1024 * 1024, chunk: int = 1024 * 1024) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1 (what the tcp KV backend gets on this host)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            payload = bytes(chunk)
            for _ in range(total // chunk):
                conn.sendall(payload)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    conn, _ = server.accept()
    buf = memoryview(bytearray(chunk))
    got, start = 0, time.perf_counter()
    with conn:
        while got < total:
            n = conn.recv_into(buf)
            if n == 0:
                break
            got += n
    elapsed = time.perf_counter() - start
    sender.join()
    server.close()
    return got / elapsed


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def profile_document(
    hardware: dict, model: ModelSpec, weight_dtype: str, points: list[Point], fit: Fit,
    decode_steps: int,
) -> dict:  # fmt: skip
    """The JSON object `pdserve profile` writes."""
    return {
        "version": PROFILE_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "hardware": hardware,
        "model": asdict(model),
        "weight_dtype": weight_dtype,
        "decode_steps": decode_steps,
        "points": [p._asdict() for p in points],
        "efficiency": asdict(fit.efficiency),
        "fit": {"median_rel_error": fit.median_rel_error, "max_rel_error": fit.max_rel_error},
    }


class Profile(NamedTuple):
    """What the simulator takes from a profile file."""

    accelerator: Accelerator
    model: ModelSpec
    efficiency: Efficiency
    weight_dtype: str
    loopback_bytes_per_s: float | None
    serving: dict[str, ServingOverhead]  # by mode; empty when not calibrated

    def loopback(self) -> Link:
        """TCP over loopback on the profiled machine, as measured."""
        if not self.loopback_bytes_per_s:
            raise ValueError("this profile has no loopback measurement: re-run `pdserve profile`")
        rate = self.loopback_bytes_per_s
        return Link("loopback", "TCP over loopback on this machine (measured)", rate, rate)

    def cluster(self, serving: bool = True) -> Cluster:
        """The profiled machine with its engine, over loopback; `serving=False` leaves out the
        serving path's overhead (the bare engine)."""
        return Cluster(self.model, self.accelerator, self.loopback(), self.efficiency,
                       self.weight_dtype, kv_dtype_of(self.weight_dtype),
                       self.serving if serving else {})  # fmt: skip


def load_profile(path: str | Path) -> Profile:
    """Read a file written by `pdserve profile`; ValueError says what is wrong with it."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"profile {str(path)!r} does not exist; create it with `pdserve profile`")
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != PROFILE_VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {PROFILE_VERSION}")
        return Profile(
            Accelerator.from_profile(doc["hardware"]),
            ModelSpec(**doc["model"]),
            Efficiency(**doc["efficiency"]),
            doc["weight_dtype"],
            doc["hardware"].get("loopback_bytes_per_s"),
            {
                mode: ServingOverhead(entry["request_s"], entry["step_s"], entry["seq_s"])
                for mode, entry in doc.get("serving", {}).items()
            },
        )
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"profile {str(path)!r} is not a valid pdserve profile ({exc}); "
            "re-create it with `pdserve profile`"
        ) from None


def save_overhead(path: str | Path, mode: str, fit: OverheadFit) -> None:
    """Record the serving overhead fitted for `mode` in the profile at `path` (replacing an
    earlier one for that mode; other modes are kept)."""
    doc = _profile_doc(path)
    doc.setdefault("serving", {})[mode] = {
        **asdict(fit.overhead),
        "raw_request_s": fit.raw_request_s,
        "raw_tpot_s_by_batch": fit.raw_tpot_s,
        "probes": fit.probes,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    Path(path).write_text(json.dumps(doc, indent=2))


def save_served_fit(
    path: str | Path, fit: Fit, accel: Accelerator, steps: int, source: str
) -> None:  # fmt: skip
    """Replace the efficiencies of the profile at `path` with `fit`, fitted to `steps` logged
    steps of a served engine (from `source`) as fractions of `accel`'s peaks (which replace the
    measured ones where higher); the bare-engine fit and the measured peaks stay in the file
    under "engine_fit"."""
    doc = _profile_doc(path)
    hw = doc["hardware"]
    doc.setdefault("engine_fit", {"efficiency": doc["efficiency"], "fit": doc["fit"],
                                  "peak_flops": hw["peak_flops"],
                                  "mem_bytes_per_s": hw["mem_bytes_per_s"]})  # fmt: skip
    hw["peak_flops"], hw["mem_bytes_per_s"] = accel.peak_flops, accel.mem_bytes_per_s
    doc["efficiency"] = asdict(fit.efficiency)
    doc["fit"] = {"median_rel_error": fit.median_rel_error, "max_rel_error": fit.max_rel_error,
                  "served_steps": steps, "source": source,
                  "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    Path(path).write_text(json.dumps(doc, indent=2))


def _profile_doc(path: str | Path) -> dict:
    """The JSON of the valid profile at `path` (ValueError as `load_profile` when not)."""
    load_profile(path)
    return json.loads(Path(path).read_text())


def calibrated(
    cluster: Cluster,
    prompt_tokens: float,
    prefill_tok_s: float | None,
    decode_batch: int,
    context_tokens: float,
    decode_step_s: float | None,
    tp: int = 1,
    gpu: str | None = None,
) -> Cluster:
    """`cluster` with the FLOP/s and memory bandwidth of its device `gpu` (None: its own
    `accel`; a pool's `Cluster.devices` entry for heterogeneous pools) scaled so that the
    latency model gives the measured speeds: a prefill of `prompt_tokens` at `prefill_tok_s`, a
    decode step of `decode_batch` sequences of `context_tokens` each in `decode_step_s` (what
    workers report in their heartbeats, at TP `tp`). A speed not measured (None or 0) leaves
    its factor as is."""
    n = int(prompt_tokens)
    step = Batch(decode_batch, decode_batch, 0, decode_batch * context_tokens, decode_batch)

    def prefill_s(c: Cluster) -> float:
        return c.latency(tp, gpu=gpu).prefill(n)

    def decode_s(c: Cluster) -> float:
        return c.latency(tp, gpu=gpu).iteration(step)

    for _ in range(3):  # the two factors interact a little through the roofline's max
        if prefill_tok_s and n >= 1:
            k = _solve(cluster, prefill_s, n / prefill_tok_s, "flops", gpu)
            cluster = _with(cluster, flops=k, gpu=gpu)
        if decode_step_s and decode_batch >= 1:
            k = _solve(cluster, decode_s, decode_step_s, "mem", gpu)
            cluster = _with(cluster, mem=k, gpu=gpu)
    return cluster


def _with(cluster: Cluster, flops: float = 1.0, mem: float = 1.0, gpu: str | None = None):
    dev = cluster.device(gpu)
    a = dev.accel
    a = replace(a, peak_flops=a.peak_flops * flops, mem_bytes_per_s=a.mem_bytes_per_s * mem)
    if gpu is None:
        return replace(cluster, accel=a)
    return replace(cluster, devices={**cluster.devices, gpu: replace(dev, accel=a)})


def _solve(cluster: Cluster, seconds, want: float, which: str, gpu: str | None = None) -> float:
    """The factor k (1e-4 .. 1e4) on the device's `which` (flops or mem) at which the
    decreasing `seconds(cluster scaled by k)` is closest to `want` (bisection on a log scale;
    fixed costs may make `want` unreachable: the bound is kept)."""
    lo, hi = math.log(1e-4), math.log(1e4)
    for _ in range(40):
        mid = (lo + hi) / 2
        if seconds(_with(cluster, **{which: math.exp(mid)}, gpu=gpu)) > want:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)
