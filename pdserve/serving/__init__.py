"""The worker process: one engine with a role (`worker`), its decode and prefill sides, its link
to the KV store, host staging of KV transfers and its load reports. The router is `pdserve.router`;
the two share only `pdserve.protocol`."""
