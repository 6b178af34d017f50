"""KV cache store: blocks keyed by (layout, chained block hash) in a DRAM and an SSD tier.

* `store.py`: the thread-safe index: pins and leases, promotion, counters; `tiers.py`: its
  tiers' bookkeeping (LRU demotion DRAM -> SSD, deletion at SSD capacity).
* `ssd.py`: one checksummed file per block; restart rebuilds the index from the files.
* `server.py`: the `pdserve store` process (thread per connection, HMAC off loopback);
  `session.py`: one connection's requests, its lease and its nixl load/put state.
* `client.py`: `StoreClient`, the engine's side: async zero-copy put, lookup, load into blocks;
  `connection.py` (reconnect, backoff, deadlines), `tickets.py` (put tickets), `put_queue.py`
  (the put thread) and `layer_load.py` (`LayerLoad`, a load reported layer by layer) serve it.
* `nixl.py`: the nixl data path (`--transport nixl`, `nixl://` endpoints): block bytes by NIXL
  READs, control on the socket; `arena.py`: the registered memory its buffers come from.
* `protocol.py`: typed frames and limits; `metrics.py`: Prometheus /metrics; `cli.py`: the
  `store` subcommand. Put/load time per tier and transport: `benchmarks/kv_store_tiers.py`.

Importing this package imports neither torch nor numpy. See docs/kv_store.md.
"""
