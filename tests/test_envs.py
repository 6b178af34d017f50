"""pdserve.envs is the one place that reads environment variables, and reads them as typed."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve
from pdserve import envs

PACKAGE = Path(pdserve.__file__).parent


def environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read `os.environ` or call `os.getenv`. Setting a variable for a child
    process or a library (`os.environ[NAME] = ...`, `os.environ.setdefault(...)`) is no read."""
    writes: set[int] = set()  # ids of the os.environ nodes that are written through
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            writes.add(id(node.value))
        elif isinstance(node, ast.Attribute) and node.attr == "setdefault":
            writes.add(id(node.value))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr in ("environ", "getenv")
        and id(node) not in writes
    ]


def test_only_envs_reads_the_environment():
    reads = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "envs.py"
        for line in environment_reads(ast.parse(path.read_text()))
    ]
    assert reads == [], "read environment variables through pdserve.envs"


def test_environment_reads_are_found():
    source = "import os\nos.environ['A'] = '1'\nos.environ.setdefault('B', '2')\nos.getenv('C')\n"
    assert environment_reads(ast.parse(source + "x = os.environ.get('D')\n")) == [4, 5]


@pytest.mark.parametrize(
    ("value", "ids"),
    [(None, None), ("", []), ("0,1", ["0", "1"]), (" 2 , 5 ,", ["2", "5"]), ("-1", ["-1"])],
)
def test_cuda_visible_devices_is_its_list_of_ids(monkeypatch, value, ids):
    monkeypatch.delenv(envs.CUDA_VISIBLE_DEVICES, raising=False)
    if value is not None:
        monkeypatch.setenv(envs.CUDA_VISIBLE_DEVICES, value)
    assert envs.cuda_visible_devices() == ids


def test_api_key_unset_is_none_and_empty_is_the_empty_key(monkeypatch):
    monkeypatch.delenv(envs.API_KEY, raising=False)
    assert envs.api_key() is None
    monkeypatch.setenv(envs.API_KEY, "")
    assert envs.api_key() == ""


def test_step_log_dir_and_kv_staging(monkeypatch, tmp_path):
    monkeypatch.setenv(envs.STEP_LOG, str(tmp_path))
    monkeypatch.setenv(envs.KV_STAGING, "True")
    assert (envs.step_log_dir(), envs.kv_staging()) == (tmp_path, True)
    monkeypatch.setenv(envs.STEP_LOG, "")
    monkeypatch.setenv(envs.KV_STAGING, "0")
    assert (envs.step_log_dir(), envs.kv_staging()) == (None, False)


def test_kv_fault_switch_is_parsed_or_refused(monkeypatch):
    monkeypatch.delenv(envs.KV_FAULT, raising=False)
    assert envs.kv_fault() is None
    monkeypatch.setenv(envs.KV_FAULT, "reset:3")
    assert envs.kv_fault() == (("reset",), 3)
    monkeypatch.setenv(envs.KV_FAULT, "reset+truncate+corrupt:4")
    assert envs.kv_fault() == (("reset", "truncate", "corrupt"), 4)
    monkeypatch.setenv(envs.KV_FAULT, "stall:40")
    assert envs.kv_fault() == (("stall",), 40)
    for bad in ("explode:3", "reset", "reset:0", "reset:x", "reset+stall:4", "reset+explode:4"):
        monkeypatch.setenv(envs.KV_FAULT, bad)
        with pytest.raises(ValueError, match=r"KIND\[\+KIND\.\.\.\]:EVERY"):
            envs.kv_fault()


def test_kernel_caches_are_bounded_at_import_unless_the_operator_set_them():
    """Shape-keyed CPU kernel caches (oneDNN's and PyTorch's) are bounded in every process that
    imports pdserve, before torch creates a kernel; an operator's own value is kept."""
    code = "import os, pdserve; print(*(os.environ[n] for n in pdserve.envs.KERNEL_CACHES))"
    env = {k: v for k, v in os.environ.items() if k not in envs.KERNEL_CACHES}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == [str(envs.KERNEL_CACHE_ENTRIES)] * 2, out.stderr
    env["LRU_CACHE_CAPACITY"] = "7"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == [str(envs.KERNEL_CACHE_ENTRIES), "7"], out.stderr
