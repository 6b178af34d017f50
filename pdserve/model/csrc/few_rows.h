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
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

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

bool amx_available();
at::Tensor mm_amx(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& sz);

// y (M, N) bf16 = x (M, K) bf16, as int8 groups, times the packed int4 weight; from `amx_from`
// rows on (measured per machine and shape: model/kernel_rows.py) by mm_amx where it runs.
inline at::Tensor mm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& sz,
                     int64_t amx_from = std::numeric_limits<int64_t>::max()) {
  if (x_in.size(0) >= amx_from && amx_available()) return mm_amx(x_in, q, sz);
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

// ---- The same int4 weights on AMX tiles (a big decode batch) -------------------------------
// Above ~16 rows the kernel above computes more than it streams (its vpdpbusd work grows with
// the rows); the dense bf16 GEMM reads 4x the bytes. Here each group of a tile's weights is
// unpacked once into bf16, (q - 8) * scale + zero in float as a B tile of k pairs, and every
// 16 rows of x (an A tile, read from x as it lies) take it in one tdpbf16ps: the unpacking is
// paid once per weight whatever the rows, the products on the tile unit, x in bf16 unrounded.
// SmolLM2's 30 layers' linears, 2 threads, Xeon with AMX (ms; the VNNI kernel / oneDNN's dense
// bf16 / this): 16 rows 6.6 / 12.3 / 6.0, 32 rows 11.9 / 14.3 / 7.2, 64 rows 23.5 / 16.6 /
// 12.8; 1 row 1.9 / 12.0 / 5.8 (the unpacking, ~30 ns a group of 512 weights, is most of it,
// and the tile products do not overlap it). Which rows run it: model/kernel_rows.py.
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)

constexpr int kAmxTiles = 4;  // C tiles of 16 rows each (tmm4..tmm7): up to 64 rows a pass

// Built with the tile instructions, and Linux hands this process the tiles' state (it does
// once asked, by arch_prctl).
inline bool amx_available() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's eight tile registers, each 16 rows of 64 bytes, for the scope's life, where
// `want` and this process may use them (`on`).
struct TileScope {
  bool on;
  explicit TileScope(bool want = true) : on(want && amx_available()) {
    if (!on) return;
    TileConfig cfg;
    for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    // by asm with cfg as its operand: GCC 12's _tile_loadconfig does not tell the compiler that
    // it reads cfg, so where this constructor is compiled out of line it may drop the stores
    // above and load a config of stack garbage (ldtilecfg then faults: SIGSEGV in every AMX
    // kernel once an unrelated change to this header moved the inlining)
    asm volatile("ldtilecfg %0" ::"m"(cfg));
  }
  ~TileScope() {
    if (on) _tile_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// The tile instructions with their registers as template arguments (GCC's intrinsics paste
// them into the instruction's text, which takes only literal numbers).
template <int D>
inline void tile_load(const void* base, int64_t stride) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(D) : "memory");
}
template <int S>
inline void tile_store(void* base, int64_t stride) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(S) : "memory");
}
template <int D>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(D));
}
template <int C, int A, int B>  // C += A B
inline void tile_dp() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
}

// Group g of a tile (its 4 loads of 64 bytes of nibbles, its 16 scales and zeros) as the B
// tile b: row r holds, for each column c, the pair k = 2r, 2r + 1 as bf16. Load j's dword c
// holds k = 8j + i (low nibbles) and 8j + 4 + i (high) of column c in byte i.
inline void unpack_b(const uint8_t* qg, const uint16_t* sg, c10::BFloat16* b) {
  const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg))), 16));
  const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sg + kTile))), 16));
  // q as the float 1 + q / 16 by its bits (q into the mantissa's top four), so
  // (q - 8) s + z = (1 + q / 16) 16 s + (z - 8 s - 16 s): no int -> float conversion
  const __m512 s16 = _mm512_mul_ps(s, _mm512_set1_ps(16.f));
  const __m512 z24 = _mm512_sub_ps(_mm512_fnmadd_ps(_mm512_set1_ps(8.f), s, z), s16);
  const __m512i top = _mm512_set1_epi32(0x00780000), one = _mm512_set1_epi32(0x3F800000);
  // cvtne2ps gives [even k's 16 columns, odd k's 16 columns]; pairs per column wanted
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  for (int j = 0; j < 4; ++j) {
    const __m512i w = _mm512_loadu_si512(qg + 64 * j);
    // the nibble at bit p of each dword, moved to bits 19..22 and or-ed into 1.0f
    const auto nibble = [&](int p) {
      const __m512i at = p <= 19 ? _mm512_slli_epi32(w, 19 - p) : _mm512_srli_epi32(w, p - 19);
      return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(at, top, one, 0xEA));  // a & b | c
    };
    // row 4j + u: k = 8j + 2u (even) and 8j + 2u + 1 (odd), at bits kEven[u] and kOdd[u]
    constexpr int kEven[4] = {0, 16, 4, 20}, kOdd[4] = {8, 24, 12, 28};
    for (int u = 0; u < 4; ++u) {
      const __m512 we = _mm512_fmadd_ps(nibble(kEven[u]), s16, z24);
      const __m512 wo = _mm512_fmadd_ps(nibble(kOdd[u]), s16, z24);
      const __m512i v = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(wo, we));
      _mm512_store_si512(b + (4 * j + u) * 32, v);
    }
  }
}

// Tile registers: A (x's rows) in tmm0 / tmm1 by turns, so a load need not wait for the
// product reading its register's last value; B (a group's weights) in tmm2 (in two by turns,
// 4 x 16 rows took 40 % longer); C (the sums of 16 rows) in tmm4 + i.
// C += x's rows times B, the last tile's 16 rows from `last` (a partial tile's, padded).
template <int T, int B, int I = 0>
inline void amx_rows(const c10::BFloat16* x, const c10::BFloat16* last, int64_t k) {
  if constexpr (I < T) {
    tile_load<I % 2>(I == T - 1 ? last : x + I * 16 * k, k * 2);
    tile_dp<4 + I, I % 2, B>();
    amx_rows<T, B, I + 1>(x, last, k);
  }
}
template <int T, int I = 0>
inline void tile_zeros() {
  if constexpr (I < T) {
    tile_zero<4 + I>();
    tile_zeros<T, I + 1>();
  }
}
template <int T, int I = 0>
inline void tile_stores(float* c) {
  if constexpr (I < T) {
    tile_store<4 + I>(c + I * 256, 64);
    tile_stores<T, I + 1>(c);
  }
}

// A tile's groups as B tiles, for an int4 weight: unit u is group u % groups of tile
// t0 + u / groups (q and sz from tile t0 on), prefetched kPrefetch units ahead.
struct Int4Groups {
  const uint8_t* q;
  const uint16_t* sz;

  void operator()(int64_t u, c10::BFloat16* b) const {
    for (int j = 0; j < 4; ++j) __builtin_prefetch(q + (u + kPrefetch) * 256 + 64 * j);
    __builtin_prefetch(sz + (u + kPrefetch) * 2 * kTile);
    unpack_b(q + u * 256, sz + u * 2 * kTile, b);
  }
};

// Tiles [t0, t1) of the weight times x's T * 16 rows (zero past `rows`) into out, each group
// unpacked by `unpack` (Int4Groups, Int8Groups from tile t0). The groups of every tile in one
// sequence, each unpacked two groups ahead of its products (unpacked just before, its B load
// held ~20 % of the samples). SmolLM2's 30 layers' linears at 64 rows, one thread: 122 ns a
// group, 87 with x 64-byte aligned (a tile row across two cache lines costs a load each), 114
// with each tile's groups all unpacked before their products.
template <int T, typename O, typename U>
void amx_tiles(const c10::BFloat16* x, const c10::BFloat16* last, int64_t k, int64_t rows,
               int64_t t0, int64_t t1, O* out, int64_t n, const U& unpack) {
  constexpr int64_t kLead = 2;
  const int64_t groups = k / kGroup, units = (t1 - t0) * groups;
  alignas(64) c10::BFloat16 b[4][16 * 32];
  alignas(64) float c[T * 256];
  for (int64_t u = 0; u < std::min(kLead, units); ++u) unpack(u, b[u & 3]);
  for (int64_t u = 0; u < units; ++u) {
    const int64_t g = u % groups;
    if (g == 0) tile_zeros<T>();
    tile_load<2>(b[u & 3], 64);
    amx_rows<T, 2>(x + g * kGroup, last + g * kGroup, k);
    if (u + kLead < units) unpack(u + kLead, b[(u + kLead) & 3]);
    if (g == groups - 1) {
      tile_stores<T>(c);
      const int64_t t = t0 + u / groups;
      for (int64_t m = 0; m < std::min<int64_t>(rows, T * 16); ++m)
        store_row(out + m * n + t * kTile, _mm512_load_ps(c + m * 16));
    }
  }
}

// The r < 16 rows of a pass's last tile (rows of k), zeros after them, in this thread's buffer
// (64-byte aligned, as at::empty's): that tile loads its 16 rows from there.
inline const c10::BFloat16* padded_tail(const c10::BFloat16* rows, int64_t r, int64_t k) {
  thread_local at::Tensor buf;
  if (!buf.defined() || buf.numel() < 16 * k) buf = at::empty({16 * k}, at::kBFloat16);
  c10::BFloat16* p = buf.data_ptr<c10::BFloat16>();
  std::memcpy(p, rows, r * k * sizeof(c10::BFloat16));
  std::memset(static_cast<void*>(p + r * k), 0, (16 - r) * k * sizeof(c10::BFloat16));
  return p;
}

// x's rows (up to T * 16) in tiles of 16; a partial last tile's from each thread's own padded
// copy (padded_tail), made inside the parallel region: one made by the calling thread was read
// by the other from its core's cache, ~9 us a call more than whole tiles (SmolLM2's 30 down
// projections on the same x again and again: 17 / 60 rows 1.74 / 2.36 -> 1.45 / 2.04 ms, as 32
// / 64). In a decode step, whose x is fresh from both threads anyway, within the noise.
template <int T, typename O, typename Make>
void amx_pass(const c10::BFloat16* x, int64_t k, int64_t rows, int64_t tiles, O* out, int64_t n,
              const Make& make) {
  if constexpr (T > 1) {
    if (rows <= (T - 1) * 16) return amx_pass<T - 1>(x, k, rows, tiles, out, n, make);
  }
  const int64_t whole = rows / 16 * 16;
  at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
    const TileScope scope;
    const c10::BFloat16* last =
        whole == rows ? x + (rows - 16) * k : padded_tail(x + whole * k, rows - whole, k);
    amx_tiles<T>(x, last, k, rows, begin, end, out, n, make(begin));
  });
}

// y (M, N) = x (M, K) bf16 times a weight whose groups `make(t0)` unpacks from tile t0 on, in
// passes of 64 rows; O: bf16, or RoundedFloat (y's bf16 values as float).
template <typename O, typename Make>
at::Tensor amx_mm(const at::Tensor& x_in, int64_t n, const Make& make, const char* name) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16, name, ": bf16 rows");
  TORCH_CHECK(amx_available(), name, ": this process may not use AMX tiles");
  const int64_t rows = x_in.size(0), k = x_in.size(1);
  at::Tensor out = out_tensor<O>(x_in, rows, n);
  O* op = reinterpret_cast<O*>(out.data_ptr());
  for (int64_t m0 = 0; m0 < rows; m0 += kAmxTiles * 16) {
    const int64_t r = std::min<int64_t>(kAmxTiles * 16, rows - m0);
    at::Tensor x = x_in.narrow(0, m0, r).contiguous();
    // tiles of rows 64-byte aligned (rows of k * 2 bytes, k % 32 == 0, stay aligned)
    if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 64 != 0) x = x.clone();
    // a partial last tile from a padded copy of its rows alone (amx_pass): a copy of every row
    // into a new zeroed tensor cost SmolLM2's 30 layers' down projections ~0.5 ms at 17-31 and
    // 60-63 rows (15-17 us a call, against 1.1-2.3 ms of products)
    amx_pass<kAmxTiles>(x.data_ptr<c10::BFloat16>(), k, r, n / kTile, op + m0 * n, n, make);
  }
  return out;
}

// y (M, N) bf16 = x (M, K) bf16 times the packed int4 weight (the layout of `mm`), on AMX.
inline at::Tensor mm_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sz) {
  const int64_t k = x.size(1), groups = k / kGroup;
  TORCH_CHECK(q.size(1) * kGroup == k && k % kGroup == 0, "few_rows::mm_amx: K does not match");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr<c10::BFloat16>());
  return amx_mm<c10::BFloat16>(x, q.size(0) * kTile, [&](int64_t t0) {
    return Int4Groups{qp + t0 * groups * 256, sp + t0 * groups * 2 * kTile};
  }, "few_rows::mm_amx");  // fmt: skip
}

#else

inline bool amx_available() { return false; }
struct TileScope {  // no tiles in this build
  bool on = false;
  explicit TileScope(bool = true) {}
};
inline at::Tensor mm_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "few_rows::mm_amx: built without AMX-BF16");
}

#endif

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

template <typename O>
at::Tensor mm8_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);

// y (M, N) bf16 = x (M, K) bf16, as int8 groups, times the packed int8 weight and its scales;
// O RoundedFloat: y's values as float32 (the fused step's logits). From `amx_from` rows on by
// mm8_amx where it runs.
template <typename O = c10::BFloat16>
inline at::Tensor mm8(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales,
                      int64_t amx_from = std::numeric_limits<int64_t>::max()) {
  if (x_in.size(0) >= amx_from && amx_available()) return mm8_amx<O>(x_in, q, scales);
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

// The int8 weight on AMX tiles (as mm_amx): each group of 32 k's of a tile's 16 columns
// unpacked to bf16 (w + 128 - 128) * scale once for every row. Entry p (4 k's) holds in dword c
// column c's k = 4p .. 4p + 3, bytes 0-1 giving B row 2p and bytes 2-3 row 2p + 1.
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)

inline void unpack8_b(const uint8_t* qg, __m512 s, c10::BFloat16* b) {
  const __m512i byte = _mm512_set1_epi32(0xFF), two23 = _mm512_set1_epi32(0x4B000000);
  const __m512 bias = _mm512_set1_ps(8388608.f + 128.f);  // the float 2^23 + u8, less 128
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  for (int e = 0; e < kGroup / 4; ++e) {
    const __m512i w = _mm512_loadu_si512(qg + 64 * e);
    const auto value = [&](int i) {  // byte i of each dword, (u8 - 128) * scale
      const __m512i at = i ? _mm512_srli_epi32(w, 8 * i) : w;
      const __m512 f = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(at, byte, two23, 0xEA));
      return _mm512_mul_ps(_mm512_sub_ps(f, bias), s);
    };
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_permutexvar_epi16(
          pairs, (__m512i)_mm512_cvtne2ps_pbh(value(2 * h + 1), value(2 * h)));
      _mm512_store_si512(b + (2 * e + h) * 32, v);
    }
  }
}

struct Int8Groups {  // as Int4Groups: q from tile t0, its columns' scales from tile t0
  const uint8_t* q;
  const uint16_t* scales;
  int64_t groups;

  void operator()(int64_t u, c10::BFloat16* b) const {
    for (int j = 0; j < 8; ++j) __builtin_prefetch(q + (u + kPrefetch) * 512 + 64 * j);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + u / groups * kTile))), 16));
    unpack8_b(q + u * 512, s, b);
  }
};

template <typename O>
at::Tensor mm8_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  const int64_t k = x.size(1), groups = k / kGroup;
  TORCH_CHECK(q.size(1) * 4 == k && k % kGroup == 0, "few_rows::mm8_amx: K does not match");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>());
  return amx_mm<O>(x, q.size(0) * kTile, [&](int64_t t0) {
    return Int8Groups{qp + t0 * groups * 512, sp + t0 * kTile, groups};
  }, "few_rows::mm8_amx");  // fmt: skip
}

#else

template <typename O>
at::Tensor mm8_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "few_rows::mm8_amx: built without AMX-BF16");
}

#endif

}  // namespace few_rows
