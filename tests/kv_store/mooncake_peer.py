"""Another process in the Mooncake pool for tests/kv_store/test_mooncake.py: a tiny engine (the
same random weights, seed 1) whose StoreLink offloads each finished request's blocks into the
pool. Run as `python mooncake_peer.py ENDPOINT`; it reads prompts (one JSON list of token ids a
line) on stdin, answers each with its output token ids once its blocks are stored, and keeps its
DRAM in the pool until stdin closes."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]  # factories; this checkout's pdserve

from factories import make_engine, make_model_files  # noqa: E402

from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.kv_store.mooncake import MooncakeStoreClient  # noqa: E402
from pdserve.kv_transfer.memory import layout_of  # noqa: E402
from pdserve.serving.store_link import StoreLink  # noqa: E402


def main(endpoint: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    engine = make_engine(make_model_files(seed=1), kv_cache_gb=0.001)
    layout = layout_of(engine.fingerprint, engine.runner.k_caches)
    client = MooncakeStoreClient(endpoint, layout, engine.runner.k_caches, engine.runner.v_caches)
    link = StoreLink(client, engine.block_manager)
    engine.connect(link)
    print("peer ready", flush=True)
    for line in sys.stdin:
        seq = engine.add_request(json.loads(line), SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_work() or link.pending:
            engine.step()
            for rid in link.poll():
                engine.release(rid)
        print(json.dumps({"out": seq.output_token_ids, "stats": client.stats()}), flush=True)
    link.close()


if __name__ == "__main__":
    main(sys.argv[1])
