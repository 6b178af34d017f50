"""Multi-head latent attention (DeepSeek-V2/V3), the attention part of the `deepseek` families.

Per token and layer the cache holds one latent of r + dr values (one "head", no per-head K/V):
the compressed KV c (r = kv_lora_rank, after its RMSNorm) and the RoPE key k_pe
(dr = qk_rope_head_dim, after RoPE) that every head shares. Each head's key is
(k_nope = W_UK c, k_pe), its value W_UV c, with W_UK and W_UV the two halves of kv_b_proj.

* Prefill up-projects the context's latents to per-head K and V and runs causal attention over
  them (compute-bound: the up-projection is paid once per context token).
* Decode runs the absorbed form, as vLLM's and SGLang's MLA backends: W_UK folded into the query
  (q_nope W_UK is an r-wide query per head, scored against c), W_UV into the output (the
  attention-weighted c, then W_UV), so a step reads only the latent: MQA with one KV "head" of
  r + dr values. `MLA.absorbed = False` decodes in the up-projected form instead (the
  reference the tests compare with, and the baseline its step time is measured against).

Shapes: T tokens, H heads (this rank's), dn = qk_nope_head_dim, dr, dv = v_head_dim, r, L keys.
"""

from __future__ import annotations

import torch

from pdserve.model.attention import AttentionMetadata, gather_blocks, sdpa_causal
from pdserve.model.parts import rms
from pdserve.model.quant import Dense
from pdserve.model.rope import apply_rope, yarn_mscale

# DeepSeek's q_a_layernorm and kv_a_layernorm are built without the config's rms_norm_eps
# (transformers' DeepseekV3RMSNorm(width)): its default.
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg) -> float:
    """1 / sqrt(dn + dr), times YaRN's mscale(factor, mscale_all_dim) squared where the RoPE is
    scaled with mscale_all_dim (as DeepSeek's `yarn_apply_mscale`)."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def deinterleave_rope_rows(w: torch.Tensor, groups: int, dr: int) -> torch.Tensor:
    """`w` (groups * rows, K) with the last `dr` rows of each group a RoPE part laid out in
    interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's checkpoints): those rows reordered to
    (x0, x2, ..., x1, x3, ...), the rotate-half layout `apply_rope` takes. Applied to q's and
    k_pe's rows alike, so every q . k is unchanged."""
    perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)]).to(w.device)
    g = w.view(groups, -1, w.shape[-1]).clone()  # (groups, rows, K)
    g[:, -dr:] = g[:, -dr:][:, perm]
    return g.view(w.shape)


def _projections(w, a: str, q_name: str, heads: int, dr: int, interleaved: bool) -> tuple:
    """(q_proj or q_a_proj, kv_a_proj_with_mqa, q_b_proj or None) weights of attention `a`,
    their RoPE rows in rotate-half order (`deinterleave_rope_rows`) if `interleaved`."""
    q, kv_a = w[f"{a}{q_name}.weight"], w[a + "kv_a_proj_with_mqa.weight"]
    q_b = w.get(a + "q_b_proj.weight") if q_name == "q_a_proj" else None  # (H*(dn+dr), q_lora)
    if interleaved:
        kv_a = deinterleave_rope_rows(kv_a, 1, dr)  # its last dr rows: k_pe
        if q_b is None:
            q = deinterleave_rope_rows(q, heads, dr)
        else:
            q_b = deinterleave_rope_rows(q_b, heads, dr)
    return q, kv_a, q_b


class MLA:
    """One layer's latent attention. `interleaved`: the checkpoint's RoPE rows come in pairs
    (DeepSeek-V2 always, V3 unless `rope_interleave` is false); they are reordered at load.
    `absorbed`: decode in the absorbed form (False: the up-projected one)."""

    def __init__(self, cfg, w: dict[str, torch.Tensor], p: str, interleaved: bool):
        a = p + "self_attn."
        biased = [n for n in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj") if f"{a}{n}.bias" in w]
        if biased:
            raise ValueError(
                f"DeepSeek attention with biases ({', '.join(biased)}; config.json "
                "attention_bias) is not supported; set attention_bias false"
            )
        self.dn, self.dr, self.dv, self.r = (
            cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        )  # fmt: skip
        self.scale = softmax_scale(cfg)
        self.absorbed = True
        kv_b = w[a + "kv_b_proj.weight"]  # (H * (dn + dv), r)
        self.heads = kv_b.shape[0] // (self.dn + self.dv)
        q_name = "q_a_proj" if cfg.q_lora_rank else "q_proj"
        q, kv_a, q_b = _projections(w, a, q_name, self.heads, self.dr, interleaved)
        # x -> (q_a or q, c, k_pe) in one matmul: both projections read the same x
        self.down = Dense(torch.cat([q, kv_a]))
        self.q_up = Dense(q_b) if q_b is not None else None
        self.q_norm = w.get(a + "q_a_layernorm.weight")
        self.kv_norm = w[a + "kv_a_layernorm.weight"]
        # kv_b stays a plain weight (not a quantizable linear): decode folds its halves in
        self.kv_b = kv_b
        uk_uv = kv_b.view(self.heads, self.dn + self.dv, self.r)
        self.w_uk, self.w_uv = uk_uv[:, : self.dn], uk_uv[:, self.dn :]  # (H, dn, r), (H, dv, r)
        self.o = Dense(w[a + "o_proj.weight"])
        self.names = {"down": (a + q_name, a + "kv_a_proj_with_mqa"), "o": (a + "o_proj",)}
        if q_b is not None:
            self.names["q_up"] = (a + "q_b_proj",)

    def linears(self):
        return [(self, attr, names) for attr, names in self.names.items()]

    def __call__(self, x, cos, sin, kv, meta: AttentionMetadata, n_heads: int, n_kv: int):
        """x (T, hidden) -> (T, hidden); kv: this layer's (latent_cache,), (blocks, block, 1,
        r + dr); every token's latent is written at meta.slot_mapping first."""
        t, h, dn, r = x.shape[0], self.heads, self.dn, self.r
        down = self.down(x)  # (T, q_a or H * (dn + dr), then r, then dr)
        q, c, k_pe = down.split([down.shape[1] - r - self.dr, r, self.dr], -1)
        if self.q_up is not None:
            q = self.q_up(rms(q, self.q_norm, LATENT_NORM_EPS))
        q = q.view(t, h, dn + self.dr)
        q = torch.cat([q[..., :dn], apply_rope(q[..., dn:], cos, sin)], -1)  # (T, H, dn + dr)
        k_pe = apply_rope(k_pe.view(t, 1, self.dr), cos, sin)[:, 0]
        latent = torch.cat([rms(c, self.kv_norm, LATENT_NORM_EPS), k_pe], -1)  # (T, r + dr)
        cache = kv[0]
        cache.view(-1, latent.shape[1]).index_copy_(0, meta.slot_mapping, latent)
        out = x.new_empty(t, h, self.dv)
        decode = self._decode_absorbed if self.absorbed else self._decode_expanded
        for g in meta.decode_groups:
            lat = gather_blocks(cache, g.block_tables)[:, :, 0]  # (b, L, r + dr)
            out[g.start : g.end] = decode(q[g.start : g.end], lat, g.mask.view(len(lat), 1, -1))
        for span in meta.prefills:
            if span.fresh:
                lat = latent[span.start : span.end]
            else:
                lat = gather_blocks(cache, span.block_table)[: span.context_len, 0]
            k, v = self._expand(lat)
            out[span.start : span.end] = sdpa_causal(
                q[span.start : span.end], k, v, scale=self.scale
            )
        return self.o(out.view(t, h * self.dv))

    def _expand(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents (..., L, r + dr) -> per-head K (..., L, H, dn + dr) and V (..., L, H, dv)."""
        kv = torch.nn.functional.linear(lat[..., : self.r], self.kv_b)
        kv = kv.view(*lat.shape[:-1], self.heads, self.dn + self.dv)
        k_pe = lat[..., None, self.r :].expand(*lat.shape[:-1], self.heads, self.dr)
        return torch.cat([kv[..., : self.dn], k_pe], -1), kv[..., self.dn :]

    def _decode_absorbed(self, q, lat, mask) -> torch.Tensor:
        """q (b, H, dn + dr), lat (b, L, r + dr), mask (b, 1, L) True = attend -> (b, H, dv)."""
        q_lat = torch.einsum("bhd,hdr->bhr", q[..., : self.dn], self.w_uk)  # W_UK into q
        scores = torch.matmul(torch.cat([q_lat, q[..., self.dn :]], -1), lat.transpose(1, 2))
        scores = (scores.float() * self.scale).masked_fill(~mask, float("-inf"))  # (b, H, L)
        o_lat = torch.matmul(scores.softmax(-1).to(q.dtype), lat[..., : self.r])  # (b, H, r)
        return torch.einsum("bhr,hvr->bhv", o_lat, self.w_uv)  # W_UV into the output

    def _decode_expanded(self, q, lat, mask) -> torch.Tensor:
        """As `_decode_absorbed`, up-projecting every cached latent to K and V first."""
        k, v = self._expand(lat)  # (b, L, H, dn + dr), (b, L, H, dv)
        scores = torch.einsum("bhd,blhd->bhl", q, k).float() * self.scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)
        return torch.einsum("bhl,blhv->bhv", probs, v)
