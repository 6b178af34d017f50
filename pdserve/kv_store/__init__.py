"""KV cache store: blocks keyed by (layout, chained block hash) in a DRAM and an SSD tier.

* `store.py`: the index, LRU demotion DRAM -> SSD, deletion at SSD capacity, pins and leases.
* `ssd.py`: one checksummed file per block; restart rebuilds the index from the files.
* `server.py`: the `pdserve store` process (thread per connection, HMAC off loopback).
* `client.py`: `StoreClient`, the engine's side: async zero-copy put, lookup, load into blocks.
* `protocol.py`: typed frames and limits; `cli.py`: the `store` subcommand.

Importing this package imports neither torch nor numpy.
"""
