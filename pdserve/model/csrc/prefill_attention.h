// Causal attention of a prompt's chunk over its context (no sliding window) in bf16 by
// AVX512-BF16's vdpbf16ps, included by decode.cpp after its helpers (load16, store16,
// round_vec, softmax). model/attention.py `_blockwise_causal` is the reference: the same
// rounding steps (q scaled and rounded to bf16, each score rounded to bf16, softmax in float,
// the probabilities rounded to bf16, the output summed in float and rounded), the float sums in
// another order.
//
// Why: a prompt's attention ran as torch matmuls over 128-query blocks at ~90 GFLOP/s (4
// prompts of 256 tokens: 152 of a 1,024-token step's 850 ms, Zen 4, 2 threads), small matrices
// with a 64-wide inner dimension. Here a tile of 16 keys is one register per pair of dims: a
// query row's 16 scores are d / 2 vdpbf16ps with no horizontal sum, and a value row pair is
// summed against a broadcast pair of probabilities the same way.
//
// The end of the file holds the same prefill's RMSNorm and RoPE in one pass each (rms_norm,
// rope): the other elementwise work a prompt chunk's eager layer does outside its GEMMs.
#pragma once

#if defined(__AVX512BF16__)
namespace prefill {

using BF = c10::BFloat16;
constexpr int64_t kKeys = 16;               // keys per score tile (one register of floats)
constexpr int64_t kBlock = 16;              // query positions per work item, at most
constexpr int64_t kScoreBytes = 256 << 10;  // an item's float scores, at most (past 1 row)
constexpr int kRows = 8;     // query rows per pass over a key tile (accumulators)
constexpr int kOutRows = 6;  // query rows per pass over the values (4 registers each at d=64)

// K of one kv head as tiles of 16 keys: tile t, dim pair j -> 32 bf16, key i's dims 2j and
// 2j + 1 at 2i and 2i + 1 (vdpbf16ps's pairs). Keys past n are zero.
void pack_keys(const BF* k, int64_t stride, int64_t n, int64_t d, BF* out) {
  const int64_t tiles = (n + kKeys - 1) / kKeys;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t j = 0; j < d / 2; ++j)
      for (int64_t i = 0; i < kKeys; ++i) {
        const int64_t key = t * kKeys + i;
        BF* o = out + ((t * d / 2 + j) * kKeys + i) * 2;
        o[0] = key < n ? k[key * stride + 2 * j] : BF(0.f);
        o[1] = key < n ? k[key * stride + 2 * j + 1] : BF(0.f);
      }
}

// V of one kv head as key pairs: pair p, dim chunk c -> 32 bf16, dim c * 16 + i of keys 2p and
// 2p + 1 at 2i and 2i + 1. Keys past n, to a multiple of 32, are zero.
void pack_values(const BF* v, int64_t stride, int64_t n, int64_t d, BF* out) {
  const int64_t pairs = (n + 31) / 32 * 16;
  for (int64_t p = 0; p < pairs; ++p)
    for (int64_t dim = 0; dim < d; ++dim)
      for (int64_t e = 0; e < 2; ++e) {
        const int64_t key = 2 * p + e;
        out[(p * d + dim) * 2 + e] = key < n ? v[key * stride + dim] : BF(0.f);
      }
}

inline __m512bh bcast_pair(const BF* p) {
  uint32_t u;
  std::memcpy(&u, p, sizeof u);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(u)));
}

// Scores of `rows` query rows (q: bf16, d wide, `ldq` apart) against key tiles [0, tiles):
// s[r * lds + key], raw float sums.
template <int R>
void score_rows(const BF* q, int64_t ldq, const BF* kp, int64_t tiles, int64_t d, float* s,
                int64_t lds) {
  for (int64_t t = 0; t < tiles; ++t) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const BF* kt = kp + t * d * kKeys;
    for (int64_t j = 0; j < d / 2; ++j) {
      const __m512bh kk = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt + j * 2 * kKeys));
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], kk, bcast_pair(q + r * ldq + 2 * j));
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * lds + t * kKeys, acc[r]);
  }
}

// out rows (bf16, d wide, `ldo` apart) = probabilities (bf16, `ldp` apart, an even count
// `keys` with zeros past each row's last key) times the packed values. d == 16 * C.
template <int R, int C>
void value_rows(const BF* p, int64_t ldp, const BF* vp, int64_t keys, BF* out, int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t pr = 0; pr < keys / 2; ++pr) {
    __m512bh vv[C];
    for (int c = 0; c < C; ++c)
      vv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(vp + (pr * C + c) * 2 * kKeys));
    for (int r = 0; r < R; ++r) {
      const __m512bh pp = bcast_pair(p + r * ldp + 2 * pr);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], vv[c], pp);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      f16v o;
      std::memcpy(&o, &acc[r][c], sizeof o);
      store16(out + r * ldo + c * 16, o);
    }
}

template <int R, typename F>
void in_passes(int64_t rows, F&& pass) {  // pass(first row, rows of this pass as a constant)
  int64_t r = 0;
  for (; r + R <= rows; r += R) pass(r, std::integral_constant<int, R>{});
  if constexpr (R > 1) {
    if (r < rows) in_passes<R - 1>(rows - r, [&](int64_t r0, auto n) { pass(r + r0, n); });
  }
}

#if defined(__AMX_BF16__)
// The same products on AMX tiles where the CPU has them (few_rows.h's tile helpers): the
// packed K tiles and V pairs above are B tiles as they lie. Scores: 16 query rows (A tiles of
// 32 dims, tmm0..) times a key tile's dim pairs (tmm4 / tmm5 by turns) into C (tmm6 / tmm7 by
// turns), stored straight into the rows' scores. Values: 16 rows' probabilities (32 keys an A
// tile, tmm0) times 16 key pairs of 16 dims (tmm1 / tmm2 by turns) into four C tiles of 16
// dims (tmm4..tmm7), a pass per 64 dims. Rows past `rows` in a last pass of 16 read the
// buffers' spare rows and are never written out. Against torch's SDPA (Xeon with AMX, 9 / 3
// heads, 2 threads; `benchmarks/prompt_attention.py`): with `probabilities`' softmax, 1.17x at
// 256 fresh tokens, 1.44x at 1,000, 1.46x for the last 1,024 of 2,048, but 0.96x at 2,048 fresh
// (SDPA's flash loop keeps no row of scores), hence a measured range of chunk sizes
// (kernel_rows.py `measure_prompt_attention`).
template <int C, int H = 0>
inline void load_query_tiles(const BF* q) {  // A tile H: the 16 rows' dims [32H, 32H + 32)
  if constexpr (H < C / 2) {
    few_rows::tile_load<H>(q + 32 * H, 16 * C * 2);
    load_query_tiles<C, H + 1>(q);
  }
}

template <int C, int Cd, int H = 0>
inline void score_tile(const BF* kt) {  // C tile Cd += the rows times key tile kt
  if constexpr (H < C / 2) {
    few_rows::tile_load<4 + H % 2>(kt + H * 16 * 32, 64);
    few_rows::tile_dp<Cd, H, 4 + H % 2>();
    score_tile<C, Cd, H + 1>(kt);
  }
}

template <int C>
void score_rows_amx(const BF* q, int64_t rows, const BF* kp, int64_t tiles, float* s,
                    int64_t lds) {
  constexpr int64_t d = 16 * C;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    load_query_tiles<C>(q + r0 * d);
    for (int64_t t = 0; t < tiles; ++t) {
      const BF* kt = kp + t * d * kKeys;
      float* st = s + r0 * lds + t * kKeys;
      if (t % 2 == 0) {
        few_rows::tile_zero<6>();
        score_tile<C, 6>(kt);
        few_rows::tile_store<6>(st, lds * 4);
      } else {
        few_rows::tile_zero<7>();
        score_tile<C, 7>(kt);
        few_rows::tile_store<7>(st, lds * 4);
      }
    }
  }
}

template <int N, int I = 0>
inline void value_tiles(const BF* vt, int64_t stride) {  // C tile 4 + I += P times dims 16 I
  if constexpr (I < N) {
    few_rows::tile_load<1 + I % 2>(vt + I * 32, stride);
    few_rows::tile_dp<4 + I, 0, 1 + I % 2>();
    value_tiles<N, I + 1>(vt, stride);
  }
}

template <int N, int I = 0>
inline void zero_or_store(float* o, int64_t ldo, bool store) {
  if constexpr (I < N) {
    if (store) {
      few_rows::tile_store<4 + I>(o + I * 16, ldo * 4);
    } else {
      few_rows::tile_zero<4 + I>();
    }
    zero_or_store<N, I + 1>(o, ldo, store);
  }
}

// o (rows, d) float = probabilities (bf16, `ldp` apart, zeros up to `keys`, a multiple of 32)
// times the packed values (pairs up to keys / 2).
template <int C>
void value_rows_amx(const BF* p, int64_t ldp, int64_t rows, const BF* vp, int64_t keys,
                    float* o) {
  constexpr int64_t d = 16 * C;
  constexpr int N = C < 4 ? C : 4;  // dim chunks of 16 a pass
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t c0 = 0; c0 < C; c0 += N) {
      zero_or_store<N>(nullptr, 0, false);
      for (int64_t k0 = 0; k0 < keys; k0 += 32) {
        few_rows::tile_load<0>(p + r0 * ldp + k0, ldp * 2);
        value_tiles<N>(vp + ((k0 / 2) * C + c0) * 2 * kKeys, C * 2 * kKeys * 2);
      }
      zero_or_store<N>(o + r0 * d + c0 * 16, d, true);
    }
}
#endif

// A row's probabilities as bf16 into p[0, width) (zeros past its n keys) from its raw float
// scores s (overwritten): softmax<BF>(s, n, scale) and the rounding to bf16 in three passes, its
// exp by exp512 and its roundings by vcvtneps2bf16 (a probability a bf16 step apart from
// softmax's, rarely). The softmax, then ~40 % of a 256-token prompt's attention, took 0.8x the
// time (SmolLM2's heads, 2 threads). The fused decode step's bf16 items take it too.
inline void probabilities(float* s, int64_t n, BF* p, int64_t width, float scale = 1.f) {
  const int64_t padded = (n + 15) / 16 * 16;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __mmask16 last = static_cast<__mmask16>((1u << (n - (padded - 16))) - 1);
  __m512 mx = ninf;
  for (int64_t t = 0; t < padded; t += 16) {  // scores rounded to bf16, as eager's matmul's
    __m512 v = _mm512_mul_ps(_mm512_cvtpbh_ps(_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t))),
                             _mm512_set1_ps(scale));
    if (t + 16 > n) v = _mm512_mask_blend_ps(last, ninf, v);
    _mm512_storeu_ps(s + t, v);
    mx = _mm512_max_ps(mx, v);
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    if (t + 16 > n) e = _mm512_maskz_mov_ps(last, e);
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t t = 0; t < padded; t += 16) {
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
    std::memcpy(p + t, &b, sizeof b);
  }
  std::memset(p + padded, 0, (width - padded) * sizeof(BF));
}

// q (n, H, d), the last n positions of a context whose k and v are (L, KV, d): bf16, each
// head's d contiguous; out (n, H, d). Query i sits at position L - n + i and sees keys up to it.
template <int C>
Tensor attend(const Tensor& q, const Tensor& k, const Tensor& v, Tensor out) {
  const int64_t n = q.size(0), L = k.size(0), offset = L - n;
  const int64_t nh = q.size(1), nkv = k.size(1), d = q.size(2), group = nh / nkv;
  const int64_t tiles = (L + kKeys - 1) / kKeys, pairs = (L + 31) / 32 * 16;  // to 32 keys
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  Tensor kp = at::empty({nkv, tiles * kKeys * d}, q.options());
  Tensor vp = at::empty({nkv, pairs * 2 * d}, q.options());
  at::parallel_for(0, nkv, 1, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) {
      pack_keys(k.data_ptr<BF>() + h * d, k.stride(0), L, d, kp.data_ptr<BF>() + h * kp.size(1));
      pack_values(v.data_ptr<BF>() + h * d, v.stride(0), L, d, vp.data_ptr<BF>() + h * vp.size(1));
    }
  });
  if (!out.defined()) out = at::empty({n, nh, d}, q.options());
  // positions per work item: 16, fewer for long contexts, so that an item's scores stay in L2
  const int64_t block = std::clamp<int64_t>(kScoreBytes / (4 * L * group), 1, kBlock);
  const int64_t blocks = (n + block - 1) / block;
  at::parallel_for(0, nkv * blocks, 1, [&](int64_t b, int64_t e) {
    // rows to a multiple of 16 (the tile passes'), probabilities to a multiple of 32 keys
    const int64_t rows_max = (block * group + 15) / 16 * 16, lds = tiles * kKeys;
    const int64_t ldp = (lds + 31) / 32 * 32 + 2;
    std::vector<BF> qs(rows_max * d, BF(0.f));
    std::vector<float> s(rows_max * lds), o;
    std::vector<BF> p(rows_max * ldp, BF(0.f));
    const few_rows::TileScope tiles_on;  // the products on AMX tiles where it has them
    if (tiles_on.on) o.resize(rows_max * d);
    for (int64_t item = b; item < e; ++item) {
      // blocks in the order first, last, second, second to last, ...: a block's work grows
      // with its position, and each thread's share of the items is then about half the work
      const int64_t h = item % nkv, j = item / nkv;
      const int64_t blk = j % 2 == 0 ? j / 2 : blocks - 1 - j / 2;
      const int64_t i0 = blk * block, i1 = std::min(n, i0 + block), rows = (i1 - i0) * group;
      const int64_t end = offset + i1;  // keys [0, end) are seen by some row of the item
      const int64_t key_tiles = (end + kKeys - 1) / kKeys, keys = (end + 1) / 2 * 2;
      // this item's query rows, position-major, scaled and rounded as eager scales them
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const BF* src = q.data_ptr<BF>() + i * q.stride(0) + (h * group + g) * d;
          BF* dst = qs.data() + ((i - i0) * group + g) * d;
          for (int64_t c = 0; c < d; c += 16) store16(dst + c, load16(src + c) * scale);
        }
      const BF* kh = kp.data_ptr<BF>() + h * kp.size(1);
#if defined(__AMX_BF16__)
      if (tiles_on.on) score_rows_amx<C>(qs.data(), rows, kh, key_tiles, s.data(), lds);
#endif
      if (!tiles_on.on)
        in_passes<kRows>(rows, [&](int64_t r0, auto nr) {
          score_rows<decltype(nr)::value>(qs.data() + r0 * d, d, kh, key_tiles, d,
                                          s.data() + r0 * lds, lds);
        });
      for (int64_t r = 0; r < rows; ++r)  // row r sees keys [0, its position]
        probabilities(s.data() + r * lds, offset + i0 + r / group + 1, p.data() + r * ldp,
                      (key_tiles * kKeys + 31) / 32 * 32);
      const BF* vh = vp.data_ptr<BF>() + h * vp.size(1);
#if defined(__AMX_BF16__)
      if (tiles_on.on) {
        value_rows_amx<C>(p.data(), ldp, rows, vh, (keys + 31) / 32 * 32, o.data());
        for (int64_t row = 0; row < rows; ++row) {
          const int64_t i = i0 + row / group, g = row % group;
          BF* dst = out.data_ptr<BF>() + (i * nh + h * group + g) * d;
          for (int64_t c = 0; c < d; c += 16) store16(dst + c, load16(o.data() + row * d + c));
        }
        continue;
      }
#endif
      in_passes<kOutRows>(rows, [&](int64_t r0, auto nr) {
        constexpr int R = decltype(nr)::value;
        BF tmp[R * 16 * C];
        value_rows<R, C>(p.data() + r0 * ldp, ldp, vh, keys, tmp, 16 * C);
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r, i = i0 + row / group, g = row % group;
          std::memcpy(out.data_ptr<BF>() + (i * nh + h * group + g) * d, tmp + r * 16 * C,
                      d * sizeof(BF));
        }
      });
    }
  });
  return out;
}

}  // namespace prefill
#endif

// model/attention.py's causal attention of a prompt's chunk, where this build has AVX512-BF16
// and head_dim is 32, 64 or 128; else an error (the caller checks `prefill_attention_dims`).
// Into `out` ((n, H, d), contiguous) where given: the fused step's rows of its output.
Tensor prefill_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, Tensor out) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "prefill_attention: bf16 q, k, v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.size(0) <= k.size(0) &&
                  k.sizes() == v.sizes() && q.size(2) == k.size(2) &&
                  q.size(1) % k.size(1) == 0,
              "prefill_attention: q (n, H, d), k and v (L >= n, KV, d)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                  q.stride(1) == q.size(2) && k.stride(1) == k.size(2) &&
                  v.stride(1) == v.size(2),
              "prefill_attention: each head's dims contiguous");
#if defined(__AVX512BF16__)
  switch (q.size(2)) {
    case 32: return prefill::attend<2>(q, k, v, out);
    case 64: return prefill::attend<4>(q, k, v, out);
    case 128: return prefill::attend<8>(q, k, v, out);
  }
#endif
  TORCH_CHECK(false, "prefill_attention: needs AVX512-BF16 and head_dim 32, 64 or 128");
}

Tensor prefill_attention(const Tensor& q, const Tensor& k, const Tensor& v) {
  return prefill_attention_into(q, k, v, Tensor());
}

// An eager bf16 step's RMSNorm and RoPE over many rows (a prefill's; model/parts.py `rms`,
// model/rope.py `apply_rope`), one pass each over the rows with both threads, rounded as the
// torch ops they replace: RMSNorm w * bf16(x / rms(x)) with the sum of squares in float; RoPE
// bf16(bf16(x * cos) + swap_halves(x) * sin).
Tensor rms_norm(const Tensor& x_in, const Tensor& w, double eps) {
  const Tensor x = x_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
                  x.dim() == 2 && x.size(1) % 16 == 0 && w.numel() == x.size(1),
              "rms_norm: bf16 rows, a multiple of 16 wide, and their bf16 weight");
  Tensor out = at::empty_like(x);
  const int64_t n = x.size(1);
  const c10::BFloat16 *xp = x.data_ptr<c10::BFloat16>(), *wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, x.size(0), 16, [&](int64_t b, int64_t e) {
    rms_rows<c10::BFloat16>(xp + b * n, wp, op + b * n, e - b, n, static_cast<float>(eps));
  });
  return out;
}

// x (rows, heads, d) with each head's d contiguous (a view of the q/k/v projection's rows),
// cos and sin (rows, 1, d); d a multiple of 32.
Tensor rope(const Tensor& x, const Tensor& cos_in, const Tensor& sin_in) {
  using BF = c10::BFloat16;
  const Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
                  sin.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && x.size(2) % 32 == 0,
              "rope: bf16 (rows, heads, d), each head contiguous, d a multiple of 32");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(cos.numel() == rows * d && sin.numel() == rows * d, "rope: cos, sin (rows, 1, d)");
  Tensor out = at::empty({rows, heads, d}, x.options());
  const BF *xp = x.data_ptr<BF>(), *cp = cos.data_ptr<BF>(), *sp = sin.data_ptr<BF>();
  BF* op = out.data_ptr<BF>();
  at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        const BF *xh = xp + r * x.stride(0) + h * d, *c = cp + r * d, *sn = sp + r * d;
        BF* oh = op + (r * heads + h) * d;
        for (int64_t i = 0; i < half; i += 16) {
          const f16v lo = load16(xh + i), hi = load16(xh + half + i);
          store16(oh + i, round_vec<BF>(lo * load16(c + i)) + hi * load16(sn + i));
          store16(oh + half + i,
                  round_vec<BF>(hi * load16(c + half + i)) + lo * load16(sn + half + i));
        }
      }
  });
  return out;
}
