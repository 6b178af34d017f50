"""`pdserve serve`'s local plan: which cores each worker is pinned to. A tensor-parallel worker
gets a share per rank when there are cores for every rank; else workers split the cores
equally, or share them round-robin when there are fewer cores than workers."""

from __future__ import annotations

from pdserve.launch.local import ServePlan


def test_a_tensor_parallel_worker_gets_a_share_of_cores_per_rank():
    plan = ServePlan.make("disagg", 1, 2, 1, list(range(8)), {"prefill": 4, "decode": 2})
    assert plan.workers == (("prefill", "0,1,2,3"), ("decode", "4,5"), ("decode", "6,7"))
    plan = ServePlan.make("colocated", 0, 1, 2, list(range(6)), {"both": 3})
    assert plan.workers == (("both", "0,1,2"), ("both", "3,4,5"))


def test_without_a_core_per_rank_workers_split_the_cores_equally():
    plan = ServePlan.make("disagg", 1, 1, 1, [0, 1], {"prefill": 1, "decode": 3})
    assert plan.workers == (("prefill", "0"), ("decode", "1"))
    assert ServePlan.make("disagg", 1, 1, 1, [0, 1, 2, 3]).workers == (
        ("prefill", "0,1"), ("decode", "2,3"),
    )  # fmt: skip


def test_with_fewer_cores_than_workers_they_share_round_robin():
    plan = ServePlan.make("disagg", 2, 1, 1, [0, 1], {"prefill": 2, "decode": 2})
    assert plan.workers == (("prefill", "0"), ("prefill", "1"), ("decode", "0"))
