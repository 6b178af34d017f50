// Int4 and int8 weights times a few rows (a decode step of a few sequences, or one sequence
// verifying k speculated tokens), included by decode.cpp.
//
// Why: torch's int4 CPU kernel costs about as much per row as for one (3072 x 576 on a Zen 5, 2
// threads: 63 us for 1 row, 178 us for 5, 403 us for 16), so a step verifying 1 + k tokens cost
// nearly k + 1 steps and the dense bf16 GEMM (4x the weight bytes) won from 5-12 rows. Here
// each 16-column tile of the weight is unpacked once and used for every row.
//
// The rows are quantized to int8 in groups of 32 (each group its own scale d = amax / 127, as
// llama.cpp's Q8 activations), so a group's sum over k of xq * q is an exact int32 and the
// float work is per group, not per weight. AVX512-VNNI's vpdpbusd does 64 u8 x s8 products an
// instruction: twice AVX512-BF16's vdpbf16ps, which this file used until 2026-12-05 with bf16
// rows (1.5x the time at 5-16 rows). Without VNNI the same integer arithmetic runs as scalar
// code the compiler vectorizes (AVX2, 3072 x 576 at 1 row: 0.32 ms, the dense GEMM's time, where
// the bf16-row kernel's vector-extension fallback took 3.7 ms). What the rows' rounding costs, perplexity on held text in
// 8-token steps (benchmarks/quality.py): int4 13.970 -> 13.986 (+0.1 %), int8 weights 13.992 ->
// 14.078 (+0.6 %). Prompts keep bf16 rows (model/quant.py `prompt_rows`). Every row is computed
// by the same instructions in the same order whatever the number of rows, so a row's result
// does not depend on the rows beside it (a verify step's first row equals a plain step).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace few_rows {

constexpr int64_t kTile = 16;   // output columns per tile: one register of floats
constexpr int64_t kGroup = 32;  // k's per scale (and zero) of the weight, and of the rows
constexpr int kMaxRows = 8;     // rows per pass over a tile (accumulators stay in registers)
// Weights are prefetched this many groups ahead of the group being summed (1 KB of int4, 2 KB
// of int8; past a tile's end, the next tile's, which the same thread takes next). The model's
// weights outgrow the L3 and stream from DRAM every step, and the hardware prefetcher left
// ~20 % of the int4 kernel's samples waiting on weight loads (perf, 16 rows). SmolLM2's 30
// layers' linears (Zen 4, 2 threads, medians of interleaved runs): 16 rows 8.3 -> 7.0 ms, 64
// rows 30 -> 25.7 ms, the int8 lm_head at 16 rows 2.1 -> 1.8 ms; 1 row within noise (2 and 8
// groups ahead did no better).
constexpr int64_t kPrefetch = 4;

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A tile row's 16 sums out: as bf16 (rounded to nearest even, as torch's cast: a NaN stays a
// NaN), or as floats holding those bf16 values (the fused step's logits, which it wants in
// float: one pass instead of a bf16 tensor then its float copy).
struct RoundedFloat {
  float v;
};

#if defined(__AVX512F__)
inline __m512i round_bf16_bits(__m512 v) {  // the bf16 in each lane's top half, low half zero
  const __m512i b = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                        _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(b, bias), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}

inline void store_row(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16_bits(v), 16)));
}

inline void store_row(RoundedFloat* p, __m512 v) {
  _mm512_storeu_ps(reinterpret_cast<float*>(p), _mm512_castsi512_ps(round_bf16_bits(v)));
}
#endif

inline void store_row(c10::BFloat16* p, const float* v) {
  for (int c = 0; c < kTile; ++c) p[c] = c10::BFloat16(v[c]);
}

inline void store_row(RoundedFloat* p, const float* v) {
  for (int c = 0; c < kTile; ++c) p[c].v = static_cast<float>(c10::BFloat16(v[c]));
}

// An (M, N) output of element type O (bf16, or RoundedFloat's floats).
template <typename O>
at::Tensor out_tensor(const at::Tensor& x, int64_t rows, int64_t n) {
  return at::empty({rows, n}, x.options().dtype(std::is_same_v<O, RoundedFloat> ? at::kFloat : at::kBFloat16));
}

// Per row m and group g: xq (int8), its scale d[m * G + g] and sums[m * G + g] = sum xq.
inline void quantize_groups(const uint16_t* x, int64_t rows, int64_t k, int8_t* xq, float* d,
                            int32_t* sums) {
  const int64_t groups = k / kGroup;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      const uint16_t* xg = x + m * k + g * kGroup;
#if defined(__AVX512F__)  // the scalar loop's arithmetic, 16 at a time
      __m512 v[2];
      for (int h = 0; h < 2; ++h)
        v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16 * h))), 16));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
      const float dg = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      __m512i sum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512i q8 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * k + g * kGroup + 16 * h),
                         _mm512_cvtepi32_epi8(q8));
        sum = _mm512_add_epi32(sum, q8);
      }
      d[m * groups + g] = dg;
      sums[m * groups + g] = _mm512_reduce_add_epi32(sum);
#else
      float v[kGroup], amax = 0.f;
      for (int i = 0; i < kGroup; ++i) {
        v[i] = bf16_to_float(xg[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      const float dg = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        const int32_t q8 = static_cast<int32_t>(std::nearbyint(v[i] * inv));
        xq[m * k + g * kGroup + i] = static_cast<int8_t>(q8);
        sum += q8;
      }
      d[m * groups + g] = dg;
      sums[m * groups + g] = sum;
#endif
    }
}

// Values a thread takes before a pass over rows is shared between the threads (a few rows'
// inputs: one thread; a 16-64-row decode step's: both). Here and in the fused step's norms and
// K/V writes (csrc/decode.cpp).
constexpr int64_t kRowGrain = 8192;

// A bf16 matrix's rows (M, K), contiguous, as int8 groups: what both kernels take, and xs =
// d * sums per row and group, the int4 kernel's zeros' factor. The rows are shared between the
// threads and the buffers left unset until written: at 64 rows, one thread quantizing into
// zeroed vectors held ~2 % of a decode step's samples while the other waited.
struct Int8Rows {
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> d, xs;
  std::unique_ptr<int32_t[]> sums;

  explicit Int8Rows(const at::Tensor& x)
      : q(new int8_t[x.numel()]), d(new float[x.numel() / kGroup]),
        xs(new float[x.numel() / kGroup]), sums(new int32_t[x.numel() / kGroup]) {
    const int64_t k = x.size(1), groups = k / kGroup;
    const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
    at::parallel_for(0, x.size(0), std::max<int64_t>(1, kRowGrain / k),
                     [&](int64_t begin, int64_t end) {
      quantize_groups(xp + begin * k, end - begin, k, q.get() + begin * k,
                      d.get() + begin * groups, sums.get() + begin * groups);
      for (int64_t i = begin * groups; i < end * groups; ++i)
        xs[i] = d[i] * static_cast<float>(sums[i]);
    });
  }
};

// ---- Int4 weights (model/quant.py `pack_few_rows`) -----------------------------------------
// w = (q - 8) * scale + zero, q in [0, 16), per group of 32 k's and column: per row m, group g
//   out[m, n] += (scale * d) * sum_k xq q + (zero - 8 scale) * (d * sum_k xq)
// The weights unpack by one and / shift per 128 of them. Layout: q (N/16, K/32, 4, 64) uint8:
// in group g, load j, byte 4c + i: low nibble q[c, 32g + 8j + i], high nibble
// q[c, 32g + 8j + 4 + i] (c a column of the tile, i < 4); sz (N/16, K/32, 2, 16) bf16: each
// group's scale then zero, per column.
#if defined(__AVX512VNNI__)

template <int R>
inline void tile(const int8_t* xq, int64_t k, const float* d, const float* xs, const uint8_t* q,
                 const uint16_t* sz, c10::BFloat16* out, int64_t ldo) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  const int64_t groups = k / kGroup;
  __m512 acc_out[R];
  for (int m = 0; m < R; ++m) acc_out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // one row: two chains (the low and the high nibbles) hide vpdpbusd's latency; more rows
    // are chains enough, and two each would not fit the 32 registers
    constexpr int C = R <= 2 ? 2 : 1;
    __m512i acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < R; ++m) acc[c][m] = _mm512_setzero_si512();
    const uint8_t* qg = q + g * 4 * 64;
    for (int j = 0; j < 4; ++j) __builtin_prefetch(qg + kPrefetch * 4 * 64 + 64 * j);
    __builtin_prefetch(sz + (g + kPrefetch) * 2 * kTile);
    for (int j = 0; j < 4; ++j) {
      const __m512i b = _mm512_loadu_si512(qg + 64 * j);
      const __m512i lo = _mm512_and_si512(b, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
      for (int m = 0; m < R; ++m) {
        const int8_t* xg = xq + m * k + g * kGroup + 8 * j;
        int32_t a0, a1;
        std::memcpy(&a0, xg, 4);
        std::memcpy(&a1, xg + 4, 4);
        acc[0][m] = _mm512_dpbusd_epi32(acc[0][m], lo, _mm512_set1_epi32(a0));
        acc[C - 1][m] = _mm512_dpbusd_epi32(acc[C - 1][m], hi, _mm512_set1_epi32(a1));
      }
    }
    const uint16_t* sg = sz + g * 2 * kTile;
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg))), 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + kTile))), 16));
    const __m512 z8 = _mm512_fnmadd_ps(eight, s, z);  // zero - 8 scale
    for (int m = 0; m < R; ++m) {
      const __m512i sum = C == 2 ? _mm512_add_epi32(acc[0][m], acc[C - 1][m]) : acc[0][m];
      const __m512 isum = _mm512_cvtepi32_ps(sum);
      const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(d[m * groups + g]));
      acc_out[m] = _mm512_fmadd_ps(isum, sd, acc_out[m]);
      acc_out[m] = _mm512_fmadd_ps(z8, _mm512_set1_ps(xs[m * groups + g]), acc_out[m]);
    }
  }
  for (int m = 0; m < R; ++m) store_row(out + m * ldo, acc_out[m]);
}

#else  // the same arithmetic in scalar code (any CPU): the integer sums are exact

template <int R>
inline void tile(const int8_t* xq, int64_t k, const float* d, const float* xs, const uint8_t* q,
                 const uint16_t* sz, c10::BFloat16* out, int64_t ldo) {
  const int64_t groups = k / kGroup;
  float acc_out[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * 4 * 64;
    for (int m = 0; m < R; ++m) {
      const int8_t* xg = xq + m * k + g * kGroup;
      for (int c = 0; c < kTile; ++c) {
        int32_t isum = 0;
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) {
            const uint8_t b = qg[64 * j + 4 * c + i];
            isum += (b & 15) * xg[8 * j + i] + (b >> 4) * xg[8 * j + 4 + i];
          }
        const float s = bf16_to_float(sz[g * 2 * kTile + c]);
        const float z8 = std::fma(-8.f, s, bf16_to_float(sz[g * 2 * kTile + kTile + c]));
        acc_out[m][c] = std::fma(static_cast<float>(isum), s * d[m * groups + g], acc_out[m][c]);
        acc_out[m][c] = std::fma(z8, xs[m * groups + g], acc_out[m][c]);
      }
    }
  }
  for (int m = 0; m < R; ++m) store_row(out + m * ldo, acc_out[m]);
}

#endif

template <int R>
void tile_rows(const int8_t* xq, int64_t k, const float* d, const float* xs, const uint8_t* q,
               const uint16_t* sz, c10::BFloat16* out, int64_t ldo, int rows) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(xq, k, d, xs, q, sz, out, ldo, rows);
  }
  tile<R>(xq, k, d, xs, q, sz, out, ldo);
}

// y (M, N) bf16 = x (M, K) bf16, as int8 groups, times the packed int4 weight.
inline at::Tensor mm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& sz) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "few_rows::mm: bf16 rows");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0) * kTile, groups = k / kGroup;
  TORCH_CHECK(q.size(1) * kGroup == k && k % kGroup == 0, "few_rows::mm: K does not match");
  const Int8Rows xr(x);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<c10::BFloat16>());
  at::Tensor out = out_tensor<c10::BFloat16>(x, rows, n);
  c10::BFloat16* ap = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n / kTile, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < rows; m += kMaxRows)
        tile_rows<kMaxRows>(xr.q.get() + m * k, k, xr.d.get() + m * groups,
                            xr.xs.get() + m * groups,
                            qp + t * (k / 2) * kTile, sp + t * groups * 2 * kTile,
                            ap + m * n + t * kTile, n,
                            static_cast<int>(std::min<int64_t>(kMaxRows, rows - m)));
  });
  return out;
}

// ---- Int8 weights, one scale per column (model/quant.py Int8Linear: the lm_head) -----------
// torch's int8 kernel: 2.5 ms for 1 row of SmolLM2's 49152 x 576 lm_head, 5.0 ms for 5.
// The weight w is stored as w + 128, vpdpbusd's unsigned operand: sum (w + 128) xq =
// sum w xq + 128 sum xq, exact in int32.
// out[m, n] = scale[n] * sum_g d[m, g] * (isum[g] - 128 sums[m, g]).
// Layout (model/quant.py Int8Linear): q (N/16, K/4, 64) uint8, byte 4c + i of entry p is
// w[c, 4p + i] + 128 (c a column of the tile).
#if defined(__AVX512VNNI__)

template <int R, typename O>
inline void tile8(const int8_t* xq, int64_t k, const float* d, const int32_t* sums,
                  const uint8_t* q, __m512 scale, O* out, int64_t ldo) {
  const int64_t groups = k / kGroup;
  __m512 acc_out[R];
  for (int m = 0; m < R; ++m) acc_out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    constexpr int C = R <= 2 ? 2 : 1;  // chains, as in tile
    __m512i acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int m = 0; m < R; ++m) acc[c][m] = _mm512_setzero_si512();
    for (int j = 0; j < kGroup / 4; ++j) __builtin_prefetch(q + ((g + kPrefetch) * (kGroup / 4) + j) * 64);
    for (int j = 0; j < kGroup / 4; ++j) {
      const __m512i w = _mm512_loadu_si512(q + (g * (kGroup / 4) + j) * 64);
      for (int m = 0; m < R; ++m) {
        int32_t a;
        std::memcpy(&a, xq + m * k + g * kGroup + 4 * j, 4);
        acc[j % C][m] = _mm512_dpbusd_epi32(acc[j % C][m], w, _mm512_set1_epi32(a));
      }
    }
    for (int m = 0; m < R; ++m) {
      __m512i sum = C == 2 ? _mm512_add_epi32(acc[0][m], acc[C - 1][m]) : acc[0][m];
      sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * sums[m * groups + g]));
      acc_out[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d[m * groups + g]),
                                   acc_out[m]);
    }
  }
  for (int m = 0; m < R; ++m) store_row(out + m * ldo, _mm512_mul_ps(acc_out[m], scale));
}

#else

template <int R, typename O>
inline void tile8(const int8_t* xq, int64_t k, const float* d, const int32_t* sums,
                  const uint8_t* q, const float* scale, O* out, int64_t ldo) {
  const int64_t groups = k / kGroup;
  float acc_out[R][kTile] = {};
  for (int64_t g = 0; g < groups; ++g)
    for (int m = 0; m < R; ++m)
      for (int c = 0; c < kTile; ++c) {
        int32_t isum = 0;
        for (int j = 0; j < kGroup / 4; ++j)
          for (int i = 0; i < 4; ++i)
            isum += q[(g * (kGroup / 4) + j) * 64 + 4 * c + i] * xq[m * k + g * kGroup + 4 * j + i];
        isum -= 128 * sums[m * groups + g];
        acc_out[m][c] = std::fma(static_cast<float>(isum), d[m * groups + g], acc_out[m][c]);
      }
  for (int m = 0; m < R; ++m) {
    for (int c = 0; c < kTile; ++c) acc_out[m][c] *= scale[c];
    store_row(out + m * ldo, acc_out[m]);
  }
}

#endif

template <int R, typename S, typename O>
void tile8_rows(const int8_t* xq, int64_t k, const float* d, const int32_t* sums,
                   const uint8_t* q, S scale, O* out, int64_t ldo, int rows) {
  if constexpr (R > 1) {
    if (rows < R) return tile8_rows<R - 1>(xq, k, d, sums, q, scale, out, ldo, rows);
  }
  tile8<R>(xq, k, d, sums, q, scale, out, ldo);
}

// y (M, N) bf16 = x (M, K) bf16, as int8 groups, times the packed int8 weight and its scales;
// O RoundedFloat: y's values as float32 (the fused step's logits).
template <typename O = c10::BFloat16>
inline at::Tensor mm8(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "few_rows::mm8: bf16 rows");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0) * kTile, groups = k / kGroup;
  TORCH_CHECK(q.size(1) * 4 == k && k % kGroup == 0, "few_rows::mm8: K does not match");
  const Int8Rows xr(x);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>());
  at::Tensor out = out_tensor<O>(x, rows, n);
  O* ap = reinterpret_cast<O*>(out.data_ptr());
  at::parallel_for(0, n / kTile, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      alignas(64) float sc[kTile];
      for (int c = 0; c < kTile; ++c) sc[c] = bf16_to_float(sp[t * kTile + c]);
#if defined(__AVX512VNNI__)
      const __m512 scale = _mm512_load_ps(sc);
#else
      const float* scale = sc;
#endif
      for (int64_t m = 0; m < rows; m += kMaxRows)
        tile8_rows<kMaxRows>(xr.q.get() + m * k, k, xr.d.get() + m * groups,
                             xr.sums.get() + m * groups, qp + t * k * kTile, scale,
                             ap + m * n + t * kTile, n,
                             static_cast<int>(std::min<int64_t>(kMaxRows, rows - m)));
    }
  });
  return out;
}

}  // namespace few_rows
