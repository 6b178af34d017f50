"""The C++ extension of `csrc/` (the fused decode step, the few-row int4/int8 kernels, the
int8-activation kernels): compiled with the machine's C++ compiler at first use and cached in a
folder named by a hash of its sources, so the second start loads it in well under a second.
Its own module, importing nothing of the model, so the linears (`quant.py`) and the fused step
(`fused.py`) can both use it."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import platform
import time
from pathlib import Path

import torch

from pdserve import envs

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "decode.cpp"
# -fopenmp: at::parallel_for is a header template, compiled here; without it its loops run on
# one thread. Only the compile step gets it: the OpenMP runtime is torch's own, already loaded.
FLAGS = ["-O3", "-march=native", "-fopenmp"]
_module = None
load_note = ""  # "built in 21.3 s" / "loaded in 0.2 s": how long the extension took here


def cpu_flags() -> str:
    """The CPU's feature flags: the build uses -march=native, so a cached build is only reused
    on a CPU with the same features."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return next((line for line in lines if line.startswith("flags")), platform.processor())


def build_dir() -> Path:
    """The build's folder: named by a hash of the source, so a changed decode.cpp builds anew
    (and of everything else the build depends on)."""
    key = hashlib.sha256()
    for part in sorted(p for p in SOURCE.parent.iterdir() if p.is_file()):  # + its headers
        key.update(part.name.encode() + part.read_bytes())
    # The paths of the source and of torch too: the build files name them, so two checkouts
    # or virtual environments sharing one folder would rebuild each other's.
    where = f"{SOURCE.resolve()}|{Path(torch.__file__).parent}|{platform.python_version()}"
    key.update(f"{where}|{FLAGS}|{torch.__version__}".encode())
    key.update(cpu_flags().encode())
    return envs.cache_dir() / "ext" / f"decode-{key.hexdigest()[:16]}"


def load_extension():
    """The compiled module (built on first call, ~20 s on 2 cores; then cached on disk)."""
    global _module, load_note
    if _module is None:
        from torch.utils import cpp_extension

        path = build_dir()
        path.mkdir(parents=True, exist_ok=True)
        built = {p: p.stat().st_mtime_ns for p in path.glob("*.so")}
        start = time.perf_counter()
        if not built:
            log.info("compiling the fused decode step into %s (once per machine, ~20 s)", path)
        with _only_builder(path):
            _module = cpp_extension.load(
                name="pdserve_decode",
                sources=[str(SOURCE)],
                extra_cflags=FLAGS,
                build_directory=str(path),
                verbose=False,
            )
        now = {p: p.stat().st_mtime_ns for p in path.glob("*.so")}
        verb = "loaded" if built and now == built else "built"
        load_note = f"{verb} in {time.perf_counter() - start:.1f} s"
        log.info("fused decode step %s", load_note)
    return _module


@contextlib.contextmanager
def _only_builder(path: Path):
    """One process at a time builds or loads in `path`, under a kernel lock that dies with its
    holder. torch's own lock is a file that a process killed mid-build leaves behind, and every
    later start then waits on it forever: held here, such a file can only be stale."""
    with open(path / "pdserve.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = path / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


_tried: list = []  # [the extension module, or None where it does not build]


def extension_or_none():
    """The extension (`load_extension`), or None where it cannot be built here (no compiler):
    for the kernels beside the fused step (few-row int4, int8 activations), whose callers then
    use torch's own. Tried once per process; a failure is logged once."""
    if not _tried:
        try:
            _tried.append(load_extension())
        except Exception as exc:
            log.warning("the C++ kernels could not be built, using torch's (slower): %s", exc)
            _tried.append(None)
    return _tried[0]


def loaded_or_none():
    """The extension if this process has loaded it already, else None: never builds it (for
    kernels an eager step may use, where a build's minute would land on a request)."""
    return _module


# Rows from which an eager bf16 step's RMSNorm and RoPE run the extension's one-pass kernels
# (a prefill's): below, torch's ops cost about the same.
EAGER_MIN_ROWS = 64


def eager_kernels(x: torch.Tensor):
    """The loaded extension, for an eager step's elementwise passes over `x` (model/parts.py
    `rms`, model/rope.py `apply_rope`): bf16 rows on CPU, at least EAGER_MIN_ROWS of them; else
    None (torch's ops, whose float32 bits the tests compare with transformers')."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[0] < EAGER_MIN_ROWS:
        return None
    return loaded_or_none()
