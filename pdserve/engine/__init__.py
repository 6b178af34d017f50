"""The inference engine inside every worker: sequences, paged KV blocks, scheduler, runner."""
