"""The live autoscaler's loop (`launch/autoscale.py`) against a RouterCore without sockets and a
policy that answers what the test says: what it counts, starts and drains."""

from __future__ import annotations

import asyncio

import pytest
from router.conftest import Recorder, load, worker

from pdserve.bench.metrics import SLO
from pdserve.launch.autoscale import AutoscaleLoop
from pdserve.router.config import RouterConfig
from pdserve.router.core import RouterCore
from pdserve.router.traffic import Traffic
from pdserve.sim.autoscale import Decision
from pdserve.sim.scale_policy import ScaleBounds, ScalePolicy


class Policy:
    """Stands in for `sim.autoscale.Autoscaler`: decides `self.want`, records observations."""

    def __init__(self, want):
        self.policy = ScalePolicy(SLO(1.0, 0.1), ScaleBounds(1, 3, 1, 3), interval_s=1.0)
        self.want, self.seen, self.speeds_known, self.cluster = want, [], True, None

    def decide(self, obs, now):
        self.seen.append(obs)
        return Decision(*self.want, ("because",), None, self.want)


class Frontend:
    def __init__(self, core):
        self.core, self.traffic, self.draining, self.autoscale = core, Traffic(), False, None


def make(want):
    core = RouterCore(RouterConfig(), channel=Recorder())
    core.workers["prefill-0"] = worker("prefill-0", "prefill", load())
    core.workers["decode-1"] = worker("decode-1", "decode", load())
    started, drained = [], []

    def start(role: str) -> str:
        started.append(f"{role}-{len(started) + 2}")
        return started[-1]

    policy = Policy(want)
    loop = AutoscaleLoop(Frontend(core), policy, start, drained.append, startup_timeout_s=30)
    return core, loop, policy, started, drained


def test_a_started_worker_counts_as_starting_until_it_registers():
    core, loop, policy, started, drained = make((1, 2))
    asyncio.run(loop.tick(100.0))
    assert started == ["decode-2"] and not drained
    assert loop.frontend.autoscale["starting"] == ["decode-2"]
    asyncio.run(loop.tick(101.0))  # still starting: counted, not started twice
    assert started == ["decode-2"] and policy.seen[-1].decode == 2
    core.workers["decode-2"] = worker("decode-2", "decode", load())  # warmed up, registered
    asyncio.run(loop.tick(102.0))
    assert loop.starting == {} and policy.seen[-1].decode == 2 and started == ["decode-2"]


def test_a_worker_that_never_registers_is_drained_after_the_startup_timeout(capsys):
    core, loop, policy, started, drained = make((1, 2))
    asyncio.run(loop.tick(100.0))
    loop.starting["decode-2"] = ("decode", 0.0)  # started long ago
    policy.want = (1, 1)
    asyncio.run(loop.tick(200.0))
    assert drained == ["decode-2"] and "did not register within 30 s" in capsys.readouterr().out


def test_scale_down_drains_starting_workers_first_then_the_least_busy():
    core, loop, policy, started, drained = make((1, 3))
    core.workers["decode-5"] = worker("decode-5", "decode", load())
    core.workers["decode-1"].inflight.add("r1")
    asyncio.run(loop.tick(100.0))  # 2 live decode workers: one more starts
    assert started == ["decode-2"]
    policy.want = (1, 1)
    asyncio.run(loop.tick(101.0))  # 3 -> 1: the starting one, then idle decode-5
    assert drained == ["decode-2", "decode-5"]
    core.workers["decode-5"].draining = True  # it said so; a draining worker is not counted
    asyncio.run(loop.tick(102.0))
    assert policy.seen[-1].decode == 1 and drained == ["decode-2", "decode-5"]


def test_the_workers_measured_speeds_calibrate_the_simulator_before_it_predicts():
    from pdserve.launch.autoscale import live_cluster
    from pdserve.model.loader import load_model_config

    core, loop, policy, *_ = make((1, 1))
    policy.cluster = live_cluster(load_model_config(None)[1])
    assert policy.speeds_known is False  # the loop turned prediction off until then
    loop.frontend.traffic.arrived(400, 64)
    asyncio.run(loop.tick(100.0))
    assert policy.speeds_known is False  # no worker has measured anything yet
    core.workers["prefill-0"].load = load(prefill_tok_s=2000.0)
    asyncio.run(loop.tick(101.0))
    assert policy.speeds_known is True
    for pool in ("prefill", "decode"):  # the decode pool has measured nothing: it borrows
        assert abs(400 / policy.cluster.latency(1, gpu=pool).prefill(400) - 2000.0) < 20


def test_each_pool_is_calibrated_to_its_own_workers_speeds():
    # Pools on different hardware (threads, weight formats): the decode pool's own prefills
    # run at 500 tokens/s, the prefill pool's at 2,000; the decode step is the decode pool's.
    from msgspec.structs import replace

    from pdserve.launch.autoscale import live_cluster
    from pdserve.model.loader import load_model_config
    from pdserve.sim.latency import Batch

    core, loop, policy, *_ = make((1, 1))
    policy.cluster = live_cluster(load_model_config(None)[1])
    loop.frontend.traffic.arrived(400, 64)
    core.workers["prefill-0"].load = load(prefill_tok_s=2000.0)
    core.workers["decode-1"].load = replace(load(prefill_tok_s=500.0, decode_step_s=0.05),
                                            running=4)  # fmt: skip
    asyncio.run(loop.tick(100.0))
    cl = policy.cluster
    assert abs(400 / cl.latency(1, gpu="prefill").prefill(400) - 2000.0) < 20
    assert abs(400 / cl.latency(1, gpu="decode").prefill(400) - 500.0) < 5
    step = cl.latency(1, gpu="decode").iteration(Batch(4, 4, 0, 4 * 432, 4))  # as measured
    assert step == pytest.approx(0.05, rel=0.02)


def test_a_worker_added_to_a_pool_gets_that_pools_own_hardware_flags():
    # serve's launch() builds every worker's flags with this, the autoscaler's added ones too
    from types import SimpleNamespace

    from pdserve.cli import build_parser
    from pdserve.launch.commands import phase_argv, pool_worker_argv

    args = SimpleNamespace(chunk_size=None, decode_chunk_size=0)
    pools = {"prefill": phase_argv("--weights bf16 --threads 1", "--prefill-args"),
             "decode": phase_argv("--weights int4 --threads 2", "--decode-args")}  # fmt: skip
    for role, weights, threads in (("prefill", "bf16", 1), ("decode", "int4", 2)):
        argv = pool_worker_argv(["--weights", "auto", "--threads", "4"], role, args, 1,
                                pools[role], "cuda:1")  # fmt: skip
        parsed = build_parser().parse_args(
            ["worker", "--role", role, "--router", "tcp://127.0.0.1:1", *argv]
        )
        assert (parsed.weights, parsed.threads, parsed.device) == (weights, threads, "cuda:1")
