"""The store as a real process (`python -m pdserve.kv_store.cli store`): restart, stall, kill -9."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from waiting import wait_until

from pdserve.kv_store.client import StoreClient

from .helpers import both_transports, make_caches, make_chain, make_layout

LAYOUT = make_layout("bfloat16", num_layers=4)


class StoreProcess:
    def __init__(self, store_dir, transport: str = "tcp") -> None:
        cmd = [sys.executable, "-m", "pdserve.kv_store.cli", "store", "--port", "0",
               "--dram-gb", "0", "--ssd-gb", "0.001", "--store-dir", str(store_dir),
               "--transport", transport]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_SECRET")}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        try:
            line = self._first_line(timeout_s=30)
        except BaseException:
            self.stop()  # whoever starts it stops it, even when it does not come up
            raise
        self.banner = line
        self.endpoint = re.search(r"listening on ((?:tcp|nixl)://\S+)", line).group(1)

    def _first_line(self, timeout_s: float) -> str:
        out: list[str] = []
        reader = threading.Thread(
            target=lambda: out.append(self.proc.stdout.readline()), daemon=True
        )
        reader.start()
        reader.join(timeout_s)
        assert out and out[0], "the store did not print its endpoint"
        return out[0]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP, and wait until the kernel has stopped it (delivery is asynchronous)."""
        self.proc.send_signal(signal.SIGSTOP)
        stat = f"/proc/{self.proc.pid}/stat"
        wait_until(
            lambda: open(stat).read().rsplit(")", 1)[1].split()[0] == "T",
            5,
            "the store to stop after SIGSTOP",
            interval_s=0.01,
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(10)


@pytest.mark.slow
@both_transports
def test_store_process_restart_stall_and_kill(tmp_path, transport):
    src, dst = make_caches(LAYOUT, 8, seed=11), make_caches(LAYOUT, 8, seed=None)
    chain = make_chain(6)
    store = StoreProcess(tmp_path, transport)
    try:
        writer = StoreClient(store.endpoint, LAYOUT, *src)
        ticket = writer.put(chain.hashes, chain.tokens, [7, 6, 5, 4, 3, 2])
        assert ticket.wait(10) and ticket.ok and ticket.stored == 6
        writer.close()
        store.signal(signal.SIGTERM)
        assert store.proc.wait(10) == 0

        store = StoreProcess(tmp_path, transport)  # restart on the same SSD tier
        assert "6 blocks recovered" in store.banner
        reader = StoreClient(store.endpoint, LAYOUT, *dst, timeout_s=1.0, connect_timeout_s=1.0)
        assert reader.load(chain.hashes, [0, 1, 2, 3, 4, 5], token_ids_per_block=chain.tokens) == 6
        for s, d in ((src[0], dst[0]), (src[1], dst[1])):
            for layer in range(LAYOUT.num_layers):
                same = s[layer][[7, 6, 5, 4, 3, 2]].view(torch.uint8)
                assert torch.equal(d[layer][:6].view(torch.uint8), same)
        assert reader.stats().hits_ssd == 6

        store.pause()  # a hung store: the load gives up at its timeout
        t0 = time.monotonic()
        assert reader.load(chain.hashes, [0, 1, 2, 3, 4, 5], timeout_s=0.5) == 0
        assert time.monotonic() - t0 < 2.5 and "timed out" in reader.last_error

        result: list[int] = []
        loader = threading.Thread(target=lambda: result.append(reader.load(chain.hashes,
                                  [0, 1, 2, 3, 4, 5], timeout_s=20)))  # fmt: skip
        t0 = time.monotonic()
        loader.start()
        wait_until(  # the loader holds the client's connection: it waits on the stopped store
            reader._lock.locked, 5, "the load to start waiting on the store", interval_s=0.01
        )
        store.signal(signal.SIGKILL)  # killed while the load waits on it
        loader.join(20)
        assert result == [0] and time.monotonic() - t0 < 5
        assert reader.lookup(chain.hashes) == 0 and "not retried" in reader.last_error
        reader.close()
    finally:
        store.stop()
