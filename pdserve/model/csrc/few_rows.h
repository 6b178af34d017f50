// Int4 weights times a few bf16 rows (a decode step of a few sequences, or one sequence
// verifying k speculated tokens), included by decode.cpp.
//
// Why: torch's int4 CPU kernel costs about as much per row as for one (3072 x 576 on a Zen 5, 2
// threads: 63 us for 1 row, 178 us for 5, 403 us for 16), so a step verifying 1 + k tokens cost
// nearly k + 1 steps and the dense bf16 GEMM (4x the weight bytes) won from 5-12 rows. Here
// each 16-column tile of the weight is unpacked once and used for every row, so a row costs
// one multiply-add per 32 weights (AVX512-BF16: vdpbf16ps over pairs of k) on top of the
// unpacking that one row pays anyway.
//
// Layout (model/quant.py `pack_few_rows`), a weight (N, K) with N % 16 == 0, K % 32 == 0:
//   q  (N/16, K/2, 16) uint8: tile t, pair p, column c: low nibble k = 2p, high nibble 2p + 1
//   sz (N/16, K/32, 2, 16) bf16: each group of 32 k's scale then zero, per column
// w = (q - 8) * scale + zero, so per row m and group g:
//   out[m, n] += scale[n, g] * sum_k x[m, k] (q[n, k] - 8) + zero[n, g] * sum_k x[m, k]
// q - 8 is exact in bf16, products are exact in float, sums are in float. Every row is
// computed by the same instructions in the same order whatever the number of rows, so a row's
// result does not depend on the rows beside it (a verify step's first row equals a plain step).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <vector>

namespace few_rows {

constexpr int64_t kTile = 16;   // output columns per tile: one register of floats
constexpr int64_t kGroup = 32;  // k's per scale and zero
constexpr int kMaxRows = 8;     // rows per pass over a tile (accumulators stay in registers)

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Sum of each row's groups of 32: xs[m * G + g], in float, pairs in order.
inline void group_sums(const uint16_t* x, int64_t rows, int64_t k, float* xs) {
  const int64_t groups = k / kGroup;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) s += bf16_to_float(x[m * k + g * kGroup + i]);
      xs[m * groups + g] = s;
    }
}

#if defined(__AVX512BF16__)

// One tile (16 columns) for R rows: out[m * ldo + c] (float).
template <int R>
inline void tile(const uint16_t* x, int64_t k, const float* xs, const uint8_t* q,
                 const uint16_t* sz, float* out, int64_t ldo) {
  // bf16 of q - 8 for q = 0..15 (the other 16 entries are never indexed)
  alignas(64) static const uint16_t kTable[32] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
  const __m512i table = _mm512_load_si512(kTable);
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  const int64_t groups = k / kGroup;
  __m512 acc_out[R];
  for (int m = 0; m < R; ++m) acc_out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
    const uint8_t* qg = q + g * (kGroup / 2) * kTile;
    for (int64_t p = 0; p < kGroup / 2; ++p) {
      // one byte per column -> (q[k] - 8, q[k + 1] - 8) as two bf16 in each 32-bit lane
      __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + p * kTile)));
      __m512i idx = _mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), nibbles);
      __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, table);
      const int64_t kk = g * kGroup + 2 * p;
      for (int m = 0; m < R; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * k + kk, sizeof pair);
        acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
    const uint16_t* sg = sz + g * 2 * kTile;
    __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg))), 16));
    __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + kTile))), 16));
    for (int m = 0; m < R; ++m) {
      acc_out[m] = _mm512_fmadd_ps(s, acc[m], acc_out[m]);
      acc_out[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(xs[m * groups + g]), acc_out[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_storeu_ps(out + m * ldo, acc_out[m]);
}

#else  // the same arithmetic in float with GCC/Clang vector extensions (any CPU)

typedef float fv16 __attribute__((vector_size(64)));
typedef uint32_t uv16 __attribute__((vector_size(64)));
typedef uint8_t bv16 __attribute__((vector_size(16)));
typedef uint16_t hv16 __attribute__((vector_size(32)));

inline fv16 widen(const uint16_t* p) {
  hv16 h;
  std::memcpy(&h, p, sizeof h);
  uv16 w = __builtin_convertvector(h, uv16) << 16;
  fv16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

template <int R>
inline void tile(const uint16_t* x, int64_t k, const float* xs, const uint8_t* q,
                 const uint16_t* sz, float* out, int64_t ldo) {
  const int64_t groups = k / kGroup;
  fv16 acc_out[R];
  for (int m = 0; m < R; ++m) acc_out[m] = fv16{};
  for (int64_t g = 0; g < groups; ++g) {
    fv16 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = fv16{};
    const uint8_t* qg = q + g * (kGroup / 2) * kTile;
    for (int64_t p = 0; p < kGroup / 2; ++p) {
      bv16 b;
      std::memcpy(&b, qg + p * kTile, sizeof b);
      uv16 d = __builtin_convertvector(b, uv16);
      fv16 lo = __builtin_convertvector(d & 15u, fv16) - 8.f;
      fv16 hi = __builtin_convertvector(d >> 4, fv16) - 8.f;
      const int64_t kk = g * kGroup + 2 * p;
      for (int m = 0; m < R; ++m)
        acc[m] += lo * bf16_to_float(x[m * k + kk]) + hi * bf16_to_float(x[m * k + kk + 1]);
    }
    const fv16 s = widen(sz + g * 2 * kTile), z = widen(sz + g * 2 * kTile + kTile);
    for (int m = 0; m < R; ++m) acc_out[m] += s * acc[m] + z * xs[m * groups + g];
  }
  for (int m = 0; m < R; ++m) std::memcpy(out + m * ldo, &acc_out[m], sizeof acc_out[m]);
}

#endif

template <int R>
void tile_rows(const uint16_t* x, int64_t k, const float* xs, const uint8_t* q,
               const uint16_t* sz, float* out, int64_t ldo, int rows) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<R - 1>(x, k, xs, q, sz, out, ldo, rows);
  }
  tile<R>(x, k, xs, q, sz, out, ldo);
}

// y (M, N) bf16 = x (M, K) bf16 times the packed weight; see the header comment.
inline at::Tensor mm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& sz) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "few_rows::mm: bf16 rows");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0) * kTile;
  TORCH_CHECK(q.size(1) * 2 == k && k % kGroup == 0, "few_rows::mm: K does not match");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<c10::BFloat16>());
  std::vector<float> xs(rows * (k / kGroup));
  group_sums(xp, rows, k, xs.data());
  at::Tensor acc = at::empty({rows, n}, x.options().dtype(at::kFloat));
  float* ap = acc.data_ptr<float>();
  const int64_t tiles = n / kTile, groups = k / kGroup;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < rows; m += kMaxRows)
        tile_rows<kMaxRows>(xp + m * k, k, xs.data() + m * groups, qp + t * (k / 2) * kTile,
                            sp + t * groups * 2 * kTile, ap + m * n + t * kTile, n,
                            static_cast<int>(std::min<int64_t>(kMaxRows, rows - m)));
  });
  return acc.to(at::kBFloat16);
}

// Int8 weights (a per-column scale: the lm_head, model/quant.py Int8Linear) times a few rows,
// for the same reason (torch's int8 kernel: 2.5 ms for 1 row of SmolLM2's 49152 x 576 lm_head,
// 5.0 ms for 5). Layout: q (N/16, K, 16) int8, column c of tile t at k; scales (N,) bf16.
// In float with vector extensions (-march=native makes them AVX-512 where the CPU has it):
// out[m, n] = scale[n] * sum_k x[m, k] q[n, k], each row in the same order whatever the rows.
typedef float f32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

#if defined(__AVX512F__)
inline f32x16 int8_column(const int8_t* p) {  // 16 int8 -> float
  return reinterpret_cast<f32x16>(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}
#else
inline f32x16 int8_column(const int8_t* p) {
  f32x16 w;
  for (int c = 0; c < kTile; ++c) w[c] = static_cast<float>(p[c]);
  return w;
}
#endif

template <int R>
inline void tile8(const float* x, int64_t k, const int8_t* q, f32x16 scale, float* out,
                  int64_t ldo) {
  f32x16 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = f32x16{};
  for (int64_t i = 0; i < k; ++i) {
    const f32x16 w = int8_column(q + i * kTile);
    for (int m = 0; m < R; ++m) acc[m] += w * x[m * k + i];
  }
  for (int m = 0; m < R; ++m) {
    f32x16 v = acc[m] * scale;
    std::memcpy(out + m * ldo, &v, sizeof v);
  }
}

template <int R>
void tile8_rows(const float* x, int64_t k, const int8_t* q, f32x16 scale, float* out,
                int64_t ldo, int rows) {
  if constexpr (R > 1) {
    if (rows < R) return tile8_rows<R - 1>(x, k, q, scale, out, ldo, rows);
  }
  tile8<R>(x, k, q, scale, out, ldo);
}

// y (M, N) bf16 = x (M, K) bf16 times the packed int8 weight and its column scales.
inline at::Tensor mm8(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, "few_rows::mm8: bf16 rows");
  const at::Tensor x = x_in.contiguous().to(at::kFloat);
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0) * kTile;
  TORCH_CHECK(q.size(1) == k, "few_rows::mm8: K does not match");
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>());
  at::Tensor acc = at::empty({rows, n}, x.options());
  float* ap = acc.data_ptr<float>();
  at::parallel_for(0, n / kTile, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      f32x16 scale;
      for (int c = 0; c < kTile; ++c) scale[c] = bf16_to_float(sp[t * kTile + c]);
      for (int64_t m = 0; m < rows; m += kMaxRows)
        tile8_rows<kMaxRows>(xp + m * k, k, qp + t * k * kTile, scale, ap + m * n + t * kTile, n,
                             static_cast<int>(std::min<int64_t>(kMaxRows, rows - m)));
    }
  });
  return acc.to(at::kBFloat16);
}

}  // namespace few_rows
