"""`--kv-store mooncake://`: a real `mooncake_master` and pool clients in separate processes.
Blocks one process offloads are loaded by another with the greedy tokens of a cold run; the
master killed mid-load means computing (exact tokens, no block held); a restarted master's pool
refills; another layout's blocks and a corrupt block are misses. Skipped, saying why, where the
Mooncake wheel or its system library (libibverbs1) is missing."""

from __future__ import annotations

import ctypes
import json
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from factories import make_engine, make_model_files, run_to_completion
from waiting import wait_until

from pdserve import envs
from pdserve.engine.block_hash import block_hashes
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_store import mooncake, mooncake_calls, mooncake_setup
from pdserve.kv_transfer.memory import layout_of
from pdserve.serving.store_link import StoreLink, split_index_events

from .helpers import MOONCAKE_SKIP

pytestmark = pytest.mark.skipif(MOONCAKE_SKIP is not None, reason=str(MOONCAKE_SKIP))

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
A = [5, 17, 33, 2, 9, 71, 8, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]  # 5 full
B = list(range(100, 121))
C = list(range(150, 171))
PEER = Path(__file__).with_name("mooncake_peer.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """A `mooncake_master` on loopback ports of its own (client TTL 2 s); restartable."""

    def __init__(self) -> None:
        self.port, self.metrics = free_port(), free_port()
        self.endpoint = f"mooncake://127.0.0.1:{self.port}?segment_mb=32&buffer_mb=8"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = mooncake_setup.master_command("127.0.0.1", self.port, self.metrics, client_ttl_s=2)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_until(listening, 20, "mooncake_master listening")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def master():
    m = Master()
    m.start()
    yield m
    m.kill()


@pytest.fixture(scope="module")
def files():
    return make_model_files(seed=1)


@pytest.fixture(scope="module")
def reference(files):
    eng = make_engine(files, enable_prefix_caching=False)
    return {tuple(p): run_to_completion(eng, [p], GREEDY)[0] for p in (A, B, C)}


def start_peer(endpoint: str):
    """(serve(prompt) -> {"out", "stats"}, its process): another process in the pool that
    offloads what it serves (its DRAM holds part of the pool)."""
    proc = subprocess.Popen([sys.executable, str(PEER), endpoint], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "peer ready"

    def serve(prompt: list[int]) -> dict:
        proc.stdin.write(json.dumps(prompt) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    return serve, proc


@pytest.fixture(scope="module")
def peer(master):
    serve, proc = start_peer(master.endpoint)
    yield serve
    proc.stdin.close()
    proc.wait(20)


@pytest.fixture(scope="module")
def local(files, master):
    """This process's engine (no local prefix cache: a hit can only come from the pool)."""
    engine = make_engine(files, kv_cache_gb=0.001, enable_prefix_caching=False)
    layout = layout_of(engine.fingerprint, engine.runner.k_caches)
    endpoint = master.endpoint + "&zero_copy=1"  # loads under a step: straight into the cache
    client = mooncake.MooncakeStoreClient(endpoint, layout, engine.runner.k_caches,
                                          engine.runner.v_caches, timeout_s=3.0)  # fmt: skip
    link = StoreLink(client, engine.block_manager, offload_finished=False)
    engine.connect(link)
    yield engine, link
    link.close()


def generate(engine, link: StoreLink, prompt: list[int]) -> list[int]:
    seq = engine.add_request(list(prompt), GREEDY)
    while engine.has_work():
        engine.step()
        for rid in link.poll():
            engine.release(rid)
    return seq.output_token_ids


def clean(engine) -> None:
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_blocks_offloaded_by_one_process_are_loaded_by_another(local, peer, reference):
    engine, link = local
    answer = peer(A)
    assert answer["out"] == reference[tuple(A)] and answer["stats"]["put_blocks"] == 6
    before = link.hit_tokens
    assert generate(engine, link, A) == reference[tuple(A)]  # the greedy tokens of a cold run
    assert link.hit_tokens - before == 20  # blocks 0-4 loaded; the last token's block computed
    held, removed = split_index_events(link.take_index_events())
    assert set(block_hashes(A, 4)[:5]) <= set(held) and not removed  # fed to the router
    assert link.client.stats()["hits"] >= 5
    clean(engine)


def test_a_call_past_its_deadline_fails_and_holds_off_the_next_until_it_returns():
    call = mooncake_calls.Caller("test")
    release = threading.Event()
    with pytest.raises(mooncake_calls.PoolError, match="took over"):
        call(0.05, release.wait, 5)
    with pytest.raises(mooncake_calls.PoolError, match="has not returned"):
        call(1.0, lambda: 1)  # its buffers may still be in use: nothing new starts
    release.set()
    wait_until(lambda: not call.stuck, 5, "the stuck call to return")
    assert call(1.0, lambda: 7) == 7
    call.close()


def test_the_endpoint_is_checked_and_the_pool_counters_are_served(local, master):
    for bad in (
        "mooncake://127.0.0.1",
        "mooncake://h:1?replica=2",
        "mooncake://h:1?replicas=x",
        "mooncake://h:1?zero_copy=yes",
    ):
        with pytest.raises(ValueError, match="mooncake"):
            mooncake_setup.parse_endpoint(bad)
    engine, link = local
    counters = link.client.counters
    port = mooncake_calls.serve_counters(counters, "127.0.0.1", 0)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for name in ("hits", "misses", "evictions_seen", "put_bytes", "load_bytes", "timeouts"):
        assert f"pdserve_kv_pool_{name}_total " in text


JOIN = """from pdserve.kv_store.mooncake_setup import import_mooncake
store = import_mooncake()[0]()
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", {master!r}) == 0
store.close()"""


@pytest.mark.parametrize(("level", "info"), [(None, False), ("INFO", True)])
def test_mooncake_logs_warnings_and_errors_unless_mc_log_level_asks_for_more(
    master, monkeypatch, level, info
):
    """Mooncake's INFO lines (every client's every step of joining and leaving the pool) flooded
    the output of each process in the pool, and its master logged a summary every 10 s."""
    if level is None:
        monkeypatch.delenv(envs.MC_LOG_LEVEL, raising=False)
    else:
        monkeypatch.setenv(envs.MC_LOG_LEVEL, level)
    join = JOIN.format(master=f"127.0.0.1:{master.port}")
    done = subprocess.run([sys.executable, "-c", join], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert any(re.match(r"I\d{4} ", line) for line in done.stderr.splitlines()) == info, done.stderr
    command = mooncake_setup.master_command("127.0.0.1", master.port, master.metrics)
    assert f"--enable_metric_reporting={str(info).lower()}" in command


def test_another_layout_and_a_corrupt_block_are_misses(local, peer, reference, master):
    engine, link = local
    peer(B)
    other = make_engine(make_model_files(seed=2), kv_cache_gb=0.001)  # another model's weights
    layout = layout_of(other.fingerprint, other.runner.k_caches)
    client = mooncake.MooncakeStoreClient(master.endpoint, layout, other.runner.k_caches,
                                          other.runner.v_caches)  # fmt: skip
    try:
        assert client.lookup(block_hashes(B, 4)) == 0  # same tokens, another layout: a miss
    finally:
        client.close()
    hashes = block_hashes(B, 4)
    c = link.client  # overwrite block 2's meta with another chain's: it must fail verification
    bad = json.dumps([hashes[2], 12345, B[8:12]]).encode()
    buf = mooncake_calls.Buffer(len(bad))
    assert c._store.register_buffer(buf.ptr, buf.size) == 0
    buf.view[:] = bad
    assert c._store.upsert_from(c._key(hashes[2], "m"), buf.ptr, len(bad)) == 0
    before = link.hit_tokens
    assert generate(engine, link, B) == reference[tuple(B)]
    assert link.hit_tokens - before == 8  # blocks 0 and 1 only: 2 is refused, the rest computed
    clean(engine)


def test_replicas_survive_kill_9_of_the_process_that_offloaded_them(local, peer, reference, master):
    engine, link = local
    serve, proc = start_peer(master.endpoint + "&replicas=2")  # a third contributor
    try:
        assert serve(C)["stats"]["put_blocks"] == 6
    finally:
        proc.kill()  # kill -9: its segment goes with it
        proc.wait(10)
    hits = []

    def loads_from_the_replica() -> bool:  # failed reads until the master drops the dead client
        before = link.hit_tokens
        assert generate(engine, link, C) == reference[tuple(C)]  # a miss is computed, never wrong
        hits.append(link.hit_tokens - before)
        return hits[-1] == 20

    wait_until(loads_from_the_replica, 20, "a load from the surviving replica", interval_s=0.3,
               state=lambda: hits)  # fmt: skip
    clean(engine)


def test_master_killed_mid_load_computes_and_a_restarted_master_refills(
    local, peer, reference, master
):
    engine, link = local
    prompt = A[:4] + B[4:]  # a prefix of its own
    peer(prompt)
    client = link.client
    real = client._store
    calls = []

    class KillAfterTheMetas:  # the master dies between the meta read and the layers
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_get_into(self, *args):  # the meta objects
            calls.append("metas")
            return real.batch_get_into(*args)

        def batch_get_into_multi_buffers(self, *args):  # a layer, straight into the cache
            calls.append("layer")
            if calls.count("layer") == 1:
                master.kill()
            return real.batch_get_into_multi_buffers(*args)

    client._store = KillAfterTheMetas()
    try:
        before = link.hit_tokens
        assert (
            generate(engine, link, prompt)
            == run_to_completion(
                make_engine(make_model_files(seed=1), enable_prefix_caching=False), [prompt], GREEDY
            )[0]
        )
    finally:
        client._store = real
    assert link.hit_tokens == before and calls[:2] == ["metas", "layer"]  # computed
    clean(engine)
    assert generate(engine, link, A) == reference[tuple(A)]  # master down: computed, bounded
    clean(engine)
    master.start()  # an empty pool: the clients re-register by themselves
    a_blocks = block_hashes(A, 4)[:5]
    assert link.client.lookup(a_blocks) == 0  # a restart empties the pool

    seen = {}

    def refilled() -> bool:
        seen["peer"] = peer(A)["stats"]  # its offloads fail until its client has re-registered
        seen["local"] = link.client.lookup(a_blocks), link.client.last_error
        return seen["local"][0] == 5

    wait_until(refilled, 30, "the pool refilled by the peer's offloads", interval_s=0.5,
               state=lambda: seen)  # fmt: skip
    before = link.hit_tokens
    assert generate(engine, link, A) == reference[tuple(A)]
    assert link.hit_tokens - before == 20  # refilled from the new offload
    clean(engine)


def test_a_zero_copy_load_past_its_deadline_writes_only_into_blocks_set_aside(
    local, peer, reference
):
    engine, link = local
    client = link.client
    assert client._into_cache  # the cache is registered: loads under a step are zero-copy
    prompt = C[:4] + A[4:]  # a prefix of its own
    want = run_to_completion(make_engine(make_model_files(seed=1), enable_prefix_caching=False),
                             [prompt], GREEDY)[0]  # fmt: skip
    peer(prompt)
    real, late = client._store, threading.Event()
    written = []

    class LateWriter:  # the first layer call outlives its deadline, then writes garbage
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
            late.wait(30)
            for k_ptr, v_ptr in ptrs:
                for ptr, size in zip((k_ptr, v_ptr), sizes[0], strict=True):
                    ctypes.memset(ptr, 0x7F, size)
                    written.append(ptr)
            return [-1] * len(keys)

    client._store, client.timeout_s = LateWriter(), 0.5
    try:
        assert generate(engine, link, prompt) == want  # computed in other blocks, exact
        aside = list(link.aside)
        assert aside and client.late_writes() == set(aside)
        assert not set(aside) & set(engine.block_manager.free_queue)  # nobody can reuse them
        engine.check_integrity()
        assert generate(engine, link, A) == reference[tuple(A)]  # fails fast, computed
    finally:
        late.set()
        client._store, client.timeout_s = real, 3.0
    wait_until(lambda: written and not client.late_writes(), 10, "the late call to return")
    assert link.poll() == [] and not link.aside  # given back once the call has returned
    clean(engine)
