"""`pdserve store`: options, errors people can act on, and a registration that stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve.kv_store.cli import main


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch):
    monkeypatch.delenv("PDSERVE_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_SECRET_FILE", raising=False)


def test_help_names_every_option(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["store", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--host",
        "--port",
        "--transport",
        "--dram-gb",
        "--ssd-gb",
        "--store-dir",
        "--secret-file",
        "--high-watermark",
        "--low-watermark",
        "--verify-on-start",
        "--metrics-port",
    ):
        assert option in out  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--host", "0.0.0.0"], "without authentication"),
        (["--secret-file", "/nonexistent/secret"], "cannot read the secret file"),
        (["--dram-gb", "-1"], "capacities must be >= 0"),
        (["--high-watermark", "0.5", "--low-watermark", "0.9"], "watermarks must satisfy"),
    ],
)
def test_bad_options_say_what_to_do(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        main(["store", "--store-dir", str(tmp_path), *extra])


def test_a_short_secret_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("short\n")
    with pytest.raises(ValueError, match="too short"):
        main(["store", "--store-dir", str(tmp_path), "--secret-file", str(secret)])


def test_registering_imports_neither_torch_nor_numpy():
    code = (
        "import argparse, sys; from pdserve.kv_store import cli; "
        "cli.register(argparse.ArgumentParser().add_subparsers()); "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_tcp_store_imports_no_torch(tmp_path):
    code = (
        "import sys; from pathlib import Path; "
        "from pdserve.kv_store.config import StoreConfig; "
        "from pdserve.kv_store.server import StoreServer; "
        "from pdserve.kv_store.store import Store; "
        f"s = StoreServer(Store(StoreConfig(1 << 20, 1 << 20, Path({str(tmp_path)!r})))); "
        "s.start(); s.close(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # nixl.py (which does) is imported for nixl stores only
