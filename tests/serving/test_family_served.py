"""`pdserve serve --model DIR` on a user's Hugging Face folder of another family: tiny random
checkpoints built with transformers' own classes (Mistral with a sliding window, through the
fused decode step; Qwen3-MoE, experts, and DeepSeek-V3, MLA with its latent cache pushed,
migrated and stored, eagerly), saved with the bundled model's tokenizer. Disaggregated (1
prefill + 2 decode workers, a KV store) and driven
through the real `openai` client: greedy tokens equal transformers' `generate`, their logprobs
its log-softmax, a json_schema answer parses and validates, a decode worker killed mid-stream
migrates its stream with the tokens of an uninterrupted run, and a prefix whose decode worker
died comes back from the KV store; every block is free after each test."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from chaos.cluster import Cluster, stream
from family_models import build
from servers import Server, metric
from waiting import wait_until

from pdserve.model.loader import load_tokenizer

pytestmark = pytest.mark.slow
N = 12
PROMPT = list(range(300, 340))  # 40 tokens: past Mistral's window of 8, 2.5 blocks
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}


class Served:
    def __init__(self, family, model, cluster):
        self.family, self.model, self.cluster = family, model, cluster
        self.url = cluster.url

    def generate(self, prompt: list[int], n: int) -> list[int]:
        """transformers' greedy tokens after `prompt`."""
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=["mistral", "qwen3_moe", "deepseek_v3"])
def served(request, tmp_path_factory):
    """One server per family, on a folder with the bundled model's tokenizer (its vocabulary
    sizes the tiny model's embeddings)."""
    folder = tmp_path_factory.mktemp(request.param)
    tokenizer = load_tokenizer()
    for f in tokenizer.path.parent.iterdir():
        shutil.copy(f, folder / f.name)
    model = build(
        request.param, folder, vocab_size=tokenizer.vocab_size, max_position_embeddings=2100
    )
    server = Server(
        "--model", str(folder), "--model-name", "tiny",
        "--mode", "disagg", "--prefill", "1", "--decode", "2", "--dtype", "float32",
        "--kv-store", "--local-prefill-threshold", "0",
        "--heartbeat-timeout-s", "2", "--kv-cache-gb", "0.25", "--no-restart",
    )  # fmt: skip
    with Cluster(server, tmp_path_factory.mktemp("logs")) as cluster:
        yield Served(request.param, model, cluster)


@pytest.fixture
def client(served):
    from openai import OpenAI

    served.cluster.ensure_all()
    yield OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
    served.cluster.assert_clean()


def test_greedy_tokens_and_their_logprobs_equal_transformers(served, client):
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    want = served.generate(PROMPT, N)
    tok = load_tokenizer()
    assert out.choices[0].text == tok.decode(want)
    with torch.no_grad():
        logits = served.model(torch.tensor([PROMPT + want])).logits[0, len(PROMPT) - 1 : -1]
    ref = torch.log_softmax(logits, -1)[torch.arange(N), torch.tensor(want)]
    got = torch.tensor(out.choices[0].logprobs.token_logprobs)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)


def test_a_json_schema_answer_parses_and_validates(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=64,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    answer = json.loads(out.choices[0].message.content)
    assert set(answer) == {"ok", "colour"}
    assert isinstance(answer["ok"], bool) and answer["colour"] in ("red", "green", "blue")


def test_a_prefix_whose_decode_worker_died_comes_back_from_the_store(served, client):
    cluster, n = served.cluster, 4
    first = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    wait_until(
        lambda: cluster.server.health().get("kv_store_blocks_known", 0) >= len(PROMPT) // 16,
        30, "the router to know of the prompt's blocks in the KV store", interval_s=0.2,
    )  # fmt: skip
    decoders = {w: h for w, h in cluster.health().items() if h["role"] == "decode"}
    holder = max(decoders, key=lambda w: decoders[w].get("prefix_query_tokens", 0))
    cluster.kill(holder)
    cluster.wait_gone(holder)
    turn2 = PROMPT + served.generate(PROMPT, n) + list(range(500, 520))
    second = client.completions.create(
        model="tiny", prompt=turn2, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    tok = load_tokenizer()
    assert first.choices[0].text == tok.decode(served.generate(PROMPT, n))
    assert second.choices[0].text == tok.decode(served.generate(turn2, n))

    def hits():
        return sum(h.get("store_hit_tokens", 0) for h in cluster.health().values())

    wait_until(lambda: hits() >= 32, 30, "store hits of the prompt's 2 full blocks")


def test_a_decode_worker_killed_mid_stream_migrates_with_the_same_tokens(served, client):
    cluster, n = served.cluster, 2000  # long: the kill must land before its end
    cluster.wait_decoders_idle()
    migrations = metric(served.url, "pdserve_migrations_total")
    victim = []

    def on_chunk(i: int) -> None:
        if i == 1:  # the router's own count names the worker at once (load reports lag)
            [busy] = [w for w, h in cluster.health().items() if h["role"] == "decode"
                      and h["inflight"]]  # fmt: skip
            victim.append(busy)
            cluster.kill(busy)

    body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    out = stream(served.url, body, on_chunk=on_chunk, timeout_s=120)
    assert (out.kind, out.completion_tokens) == ("ok", n), out
    assert out.text == load_tokenizer().decode(served.generate(PROMPT, n))
    assert metric(served.url, "pdserve_migrations_total") == migrations + 1
