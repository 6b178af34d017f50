"""`check_prompt`: whether an engine can serve a prompt at all, with what to change if not
(the worker answers a refusal as a 400 that the client reads)."""

from __future__ import annotations

from pdserve.protocol.sampling import SamplingParams


def check_prompt(
    token_ids: list[int], params: SamplingParams, max_model_len: int, vocab: int,
    num_blocks: int, block_size: int,
) -> None:  # fmt: skip
    """Raise ValueError saying what to change when the prompt cannot be served."""
    if not token_ids:
        raise ValueError("the prompt is empty: give at least one token of text")
    if len(token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens but the context window is "
            f"{max_model_len}: shorten the prompt to at most {max_model_len - 1}"
        )
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    if any(t >= vocab for t, _ in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
    blocks = -(-(len(token_ids) + 1) // block_size)
    if blocks > num_blocks:
        raise ValueError(
            f"the prompt needs {blocks} KV blocks but the cache has only "
            f"{num_blocks}: raise --kv-cache-gb or shorten the prompt"
        )
