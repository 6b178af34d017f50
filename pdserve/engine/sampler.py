"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from pdserve.engine.sequence import Sequence


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits (V,) outside the top-k and the top-p nucleus with -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of logits (N, V), float32; row i belongs to seqs[i]."""
    if all(s.params.greedy for s in seqs):
        return logits.argmax(-1).tolist()
    out = []
    for row, seq in zip(logits, seqs, strict=True):
        p = seq.params
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        if p.seed is not None and seq.generator is None:
            seq.generator = torch.Generator().manual_seed(p.seed)
        probs = _filter(row / p.temperature, p.top_k, p.top_p).softmax(-1)
        if not torch.isfinite(probs).all():  # degenerate settings: fall back to the argmax
            out.append(int(row.argmax()))
            continue
        out.append(int(torch.multinomial(probs.cpu(), 1, generator=seq.generator)))
    return out
