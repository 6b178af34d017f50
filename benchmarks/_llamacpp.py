"""Find or build llama.cpp's binaries (the anchor pdserve is measured against), shared by
vs_llamacpp.py and quality.py.

Looks in $LLAMA_CPP_BIN, then in the default build folder; else builds there with
../shared/tools/build-llama-cpp.sh (~5 minutes on 2 cores), unless --no-build.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = ROOT.parent / "shared" / "tools" / "build-llama-cpp.sh"
DEFAULT_DIR = Path(
    os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "pdserve" / "llama.cpp")
)
TOOLS = ("llama-bench", "llama-server", "llama-perplexity")


def _has_tools(path: Path) -> bool:
    return all((path / t).exists() for t in TOOLS)


def find_bin(build: bool = True) -> Path | None:
    """The folder holding llama-bench, llama-server and llama-perplexity, or None."""
    env = os.environ.get("LLAMA_CPP_BIN")
    candidates = [Path(env)] if env else []
    candidates += sorted(DEFAULT_DIR.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin"))
    for c in candidates:
        if _has_tools(c):
            return c
    if not build:
        return None
    if not BUILD_SCRIPT.exists():
        raise SystemExit(f"llama.cpp not found and {BUILD_SCRIPT} is missing: set LLAMA_CPP_BIN")
    print(f"building llama.cpp into {DEFAULT_DIR} (~5 min on 2 cores) ...", flush=True)
    out = subprocess.run(
        ["bash", str(BUILD_SCRIPT), str(DEFAULT_DIR)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"building llama.cpp failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def no_repack(tool: str) -> tuple[str, ...]:
    """The flag that keeps `tool` off llama.cpp's AMX kernels on a CPU with AMX, where this
    commit's `ggml_backend_amx_mul_mat` segfaults (the weights stay in the GGUF's layout, as on
    a CPU without AMX); nothing elsewhere."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists() or "amx_int8" not in cpuinfo.read_text():
        return ()
    return ("--repack", "0") if tool == "llama-bench" else ("--no-repack",)
