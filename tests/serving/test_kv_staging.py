"""Host staging of KV transfers (the GPU path), run on CPU: the pool's bookkeeping, exact copies
both ways, and a real disaggregated server whose workers stage every transfer
(`PDSERVE_KV_STAGING=1`) answering exactly as the offline engine does."""

from __future__ import annotations

import httpx
import pytest
import torch
from launch.test_serve_e2e import PROMPTS, completion_ids
from servers import Server

from pdserve.serving.kv_staging import HostStaging

CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]
# cpu: the GPU path's bookkeeping and copies, forced on a CPU cache; cuda: the real thing
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=CUDA)]


def caches(num_blocks=6, layers=3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, 4, 2, 8)
    return (
        [torch.randn(shape, generator=g).to(device) for _ in range(layers)],
        [torch.randn(shape, generator=g).to(device) for _ in range(layers)],
    )


def test_take_release_and_a_full_pool():
    staging = HostStaging(*caches(), num_blocks=5)
    a = staging.take("a", 3)
    assert len(set(a)) == 3 and staging.num_free == 2
    assert staging.take("b", 3) is None and staging.num_free == 2  # nothing taken
    with pytest.raises(ValueError, match="already holds"):
        staging.take("a", 1)
    b = staging.take("b", 2)
    assert not set(a) & set(b) and staging.num_free == 0
    staging.check()
    staging.release("a")
    staging.release("a")  # twice is harmless
    staging.release("never")
    assert staging.num_free == 3
    staging.check()


def test_check_finds_a_leaked_block():
    staging = HostStaging(*caches(), num_blocks=4)
    staging.take("a", 2)
    staging._free.pop()  # a block neither free nor lent
    with pytest.raises(AssertionError, match="leaked"):
        staging.check()


def test_take_prefers_one_contiguous_run():
    staging = HostStaging(*caches(), num_blocks=6)
    assert [staging.take(t, 1) for t in "abc"] == [[0], [1], [2]]
    staging.release("b")
    assert staging.take("d", 2) == [3, 4]  # the run after the hole, not [1, 3]
    assert staging.take("e", 2) == [1, 5]  # no run of two left: the lowest free blocks
    staging.check()


def fragment(staging: HostStaging) -> None:
    """Leave the pool's free blocks without a run of three."""
    for t in range(staging.num_blocks):
        staging.take(f"f{t}", 1)
    for t in range(0, staging.num_blocks, 2):
        staging.release(f"f{t}")


@pytest.mark.parametrize("fragmented", [False, True], ids=["one-run", "scattered"])
@pytest.mark.parametrize("device", DEVICES)
def test_blocks_go_to_host_and_back_exactly(device, fragmented):
    k, v = caches(seed=1, device=device)
    sender = HostStaging(k, v, num_blocks=6)
    assert not sender.k_caches[0].is_cuda
    assert sender.k_caches[0].is_pinned() == (device == "cuda")
    if fragmented:
        fragment(sender)
    host = sender.take("t", 3)
    assert (host[-1] - host[0] == 2) != fragmented
    for layer in range(3):
        if layer == 1:  # as a chunked prompt's are: a block, then the next chunk's two
            assert sender.to_host("t", layer, [5]) == host[:1]
            assert sender.to_host("t", layer, [0, 2], at=1) == host[1:]
        else:
            assert sender.to_host("t", layer, [5, 0, 2]) == host
        for dev, stage in ((k, sender.k_caches), (v, sender.v_caches)):
            assert torch.equal(stage[layer][host], dev[layer][[5, 0, 2]].cpu())
    k2, v2 = caches(seed=2, device=device)
    receiver = HostStaging(k2, v2, num_blocks=6)
    if fragmented:
        fragment(receiver)
    landed = receiver.take("t", 3)
    for layer in range(3):  # what a connector does: bytes into the receiver's host blocks
        receiver.k_caches[layer][landed] = sender.k_caches[layer][host]
        receiver.v_caches[layer][landed] = sender.v_caches[layer][host]
    untouched = k2[0][1].clone()
    receiver.to_device("t", [3, 4, 1])
    for layer in range(3):
        assert torch.equal(k2[layer][[3, 4, 1]], k[layer][[5, 0, 2]])
        assert torch.equal(v2[layer][[3, 4, 1]], v[layer][[5, 0, 2]])
    assert not torch.equal(k2[0][1], untouched)  # block 1 was a destination
    assert torch.equal(k2[0][0], caches(seed=2, device=device)[0][0][0])  # block 0 was not
    with pytest.raises(ValueError, match="holds 3 host blocks, not 2"):
        receiver.to_device("t", [0, 1])


@pytest.mark.parametrize("device", DEVICES)
def test_an_mla_latent_cache_goes_to_host_and_back_without_v(device):
    """A latent cache (one tensor per layer, `v_caches` empty) stages as K alone."""
    latent = caches(seed=3, device=device)[0]
    sender = HostStaging(latent, [], num_blocks=6)
    assert sender.v_caches == []
    host = sender.take("t", 2)
    for layer in range(3):
        sender.to_host("t", layer, [4, 1])
        assert torch.equal(sender.k_caches[layer][host], latent[layer][[4, 1]].cpu())
    dest = caches(seed=4, device=device)[0]
    receiver = HostStaging(dest, [], num_blocks=6)
    landed = receiver.take("t", 2)
    for layer in range(3):
        receiver.k_caches[layer][landed] = sender.k_caches[layer][host]
    receiver.to_device("t", [0, 5])
    assert all(torch.equal(dest[la][[0, 5]], latent[la][[4, 1]]) for la in range(3))


def test_sized_holds_two_longest_prompts_but_never_more_than_the_cache():
    k, v = caches(num_blocks=64)
    assert HostStaging.sized(k, v, max_model_len=40, gb=1e-9).num_blocks == 20  # 2 x 10 blocks
    assert HostStaging.sized(k, v, max_model_len=4096, gb=1e-9).num_blocks == 64
    assert HostStaging.sized(k, v, max_model_len=8, gb=1.0).num_blocks == 64


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_staged_disagg_server_matches_the_offline_engine(device):
    from pdserve import LLM, SamplingParams

    llm = LLM(dtype="float32", device=device)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    tok = llm.tokenizer
    want = {p: tok.decode(llm.generate(p, params)[0].token_ids) for p in PROMPTS}
    with Server(
        "--mode", "disagg", "--dtype", "float32", "--local-prefill-threshold", "0",
        "--kv-cache-gb", "0.25", "--device", device, env={"PDSERVE_KV_STAGING": "1"},
    ) as server:  # fmt: skip
        # the long prompt twice: the second finds its prefix cached on the decode worker, so
        # only the blocks after it are staged
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]  # $PDSERVE_MODEL's
        for prompt in [*PROMPTS, PROMPTS[-1]]:
            assert completion_ids(server, prompt, tok, False, model) == want[prompt], prompt
        metrics = httpx.get(server.url + "/metrics").text
        remote = [
            line
            for line in metrics.splitlines()
            if line.startswith('pdserve_prefill_decisions_total{where="remote"}')
        ]
        assert remote and float(remote[0].split()[-1]) >= len(PROMPTS) + 1
        server.wait_idle_and_clean()  # every block free, block manager intact
