"""What the autoscaling tests share (local and Ray launchers): a burst from a well-behaved
client, and "the pools are at these sizes"."""

from __future__ import annotations

import threading

import openai
from servers import Server, live_workers

GREEDY = {"max_tokens": 24, "temperature": 0}
# ~275 prompt tokens each: this machine prefills ~300 tokens/s per core in float32
PROMPTS = [f"Chapter {i}. " + "The keeper climbed the lighthouse stairs at dusk. " * 30
           for i in range(12)]  # fmt: skip


def well_behaved(url: str) -> tuple[openai.OpenAI, str]:
    """The OpenAI client, which retries a 429 (the TTFT SLO refusing) after its Retry-After,
    and the served model's name."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=30, timeout=180)
    return client, client.models.list().data[0].id


def reference_texts(url: str, prompts: list[str]) -> dict[str, str]:
    """Each prompt's greedy text from an undisturbed run: one request at a time (all at once
    would itself scale the pools), from the well-behaved client (on a loaded machine even one
    prompt can be refused under the SLO at first)."""
    client, model = well_behaved(url)
    return {p: client.completions.create(model=model, prompt=p, **GREEDY).choices[0].text
            for p in prompts}  # fmt: skip


def burst(
    url: str, prompts: list[str], stop: threading.Event
) -> tuple[list[threading.Thread], dict[str, list[str]]]:
    """Send every prompt at once, and again as each answer comes, until `stop` is set, from the
    well-behaved client. Returns the running threads and every answer's text per prompt."""
    client, model = well_behaved(url)
    out: dict[str, list[str]] = {p: [] for p in prompts}

    def one(prompt: str) -> None:
        while not stop.is_set():
            r = client.completions.create(model=model, prompt=prompt, **GREEDY)
            out[prompt].append(r.choices[0].text)

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    return threads, out


def at(server: Server, prefill: int, decode: int) -> bool:
    """The pools are at these sizes and the autoscaler wants them so, with nothing starting."""
    status = server.health()["autoscale"]
    return (live_workers(server.url) == (prefill, decode) and status["target"] == [prefill, decode]
            and not status["starting"])  # fmt: skip
