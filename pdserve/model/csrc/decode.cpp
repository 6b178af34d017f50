// The decode step of a dense model as one C++ call: every layer's RMSNorm, q/k/v biases (Qwen2),
// per-head q/k RMSNorm (Qwen3), RoPE, KV cache write, paged attention (over a sliding window:
// Mistral), SwiGLU and residuals fused into a few loops, the linears as model/quant.py runs
// them (dense; int4 or int8 by few_rows.h's kernels or torch's). Built at first use by
// model/fused.py. What a model does not have costs nothing: the parts are skipped, and no
// window means the whole context.
//
// Why: at batch 1 an eager step on 2 CPU cores spent ~5 ms of its ~8 in ~1,400 small torch ops
// (1-12 us each of dispatch and allocation), against ~3 ms in the weights themselves.
//
// Rounding follows the eager model (model/llama.py, model/attention.py) step by step: each
// op's result is rounded to the activation dtype where eager's op would round it; only the
// order of summation differs (float32 logits agree to 1e-4: tests/engine/test_fused_decode.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <limits>
#include <optional>
#include <vector>

#include <unistd.h>

#include "few_rows.h"

using at::Tensor;

namespace {


template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// 16 floats in one register (AVX-512 where -march=native has it; the compiler splits it
// otherwise): GCC/Clang vector extensions, so no intrinsics tie the code to one instruction set.
typedef float f16v __attribute__((vector_size(64)));
typedef uint32_t u32v __attribute__((vector_size(64)));
typedef uint16_t u16v __attribute__((vector_size(32)));

inline f16v load16(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f16v load16(const c10::BFloat16* p) {  // bf16 is the top half of a float's bits
  u16v h;
  std::memcpy(&h, p, sizeof h);
  u32v w = __builtin_convertvector(h, u32v) << 16;
  f16v v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

typedef int32_t i32v __attribute__((vector_size(64)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));

#if defined(__AVX512F__)
inline float hsum(f16v v) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v)); }
#else
inline float hsum(f16v v) {  // halving: two vector adds, then four scalars
  f8v lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  f8v s8 = lo + hi;
  f4v a, b;
  std::memcpy(&a, &s8, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&s8) + sizeof a, sizeof b);
  f4v s4 = a + b;
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}
#endif


// 16 values rounded to T's precision (round to nearest even, as a cast to bf16; scores and
// probabilities are finite, so no NaN case).
template <typename T>
inline f16v round_vec(f16v v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    u32v b;
    std::memcpy(&b, &v, sizeof b);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&v, &b, sizeof v);
    return v;
  }
}

// 16 floats stored as T (bf16: rounded to nearest even, as round_vec).
inline void store16(float* p, f16v v) { std::memcpy(p, &v, sizeof v); }

inline void store16(c10::BFloat16* p, f16v v) {
  v = round_vec<c10::BFloat16>(v);
  u32v b;
  std::memcpy(&b, &v, sizeof b);
  u16v h = __builtin_convertvector(b >> 16, u16v);
  std::memcpy(p, &h, sizeof h);
}

// Int8 activations (model/act_quant.py, whose torch code is the reference: the same float
// operations in the same order, so both give the same bits). quantize_rows: x (M, K) times
// inv_smooth (K) -> q (M, K) int8 and s (M, 1), per row s = max(max|x * inv| / 127, 1e-12) and
// q = rint(x * inv / s) (half to even, as torch.round). dequantize_rows: acc (M, N) int32 ->
// acc * s * scales (N), rounded to T (to nearest even, as a cast to bf16).
inline float as_float(float v) { return v; }
inline float as_float(c10::BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store_as(float* p, float v) { *p = v; }
inline void store_as(c10::BFloat16* p, float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  p->x = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

typedef int8_t i8v16 __attribute__((vector_size(16)));

// Round to the nearest integer, half to even (as rint in the default rounding mode): adding
// and taking away 1.5 * 2^23 leaves the integer part for |v| < 2^22 (int8 values here).
inline f16v rint16(f16v v) {
  const float magic = 12582912.f;
  return (v + magic) - magic;
}

// The largest |x[i]| of n floats.
inline float abs_max(const float* x, int64_t n) {
  int64_t j = 0;
  f16v vmax = {};
  for (; j + 16 <= n; j += 16) {
    const f16v v = load16(x + j);
    const f16v a = v < 0 ? -v : v;
    vmax = vmax > a ? vmax : a;
  }
  float amax = 0.f;
  for (int i = 0; i < 16; ++i) amax = std::max(amax, vmax[i]);
  for (; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  return amax;
}

// q = round(x / s), half to even (as torch.round), for n floats whose quotients fit int8.
inline void round_div_int8(const float* x, float s, int8_t* q, int64_t n) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const i32v iv = __builtin_convertvector(rint16(load16(x + j) / s), i32v);
    const i8v16 b = __builtin_convertvector(iv, i8v16);
    std::memcpy(q + j, &b, sizeof b);
  }
  for (; j < n; ++j) q[j] = static_cast<int8_t>(std::nearbyint(x[j] / s));
}

template <typename T>
void quantize_rows_impl(const T* x, const float* inv, int8_t* q, float* s, int64_t m, int64_t k) {
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(k);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * k;
      int64_t j = 0;
      for (; j + 16 <= k; j += 16) {
        const f16v v = load16(xr + j) * load16(inv + j);
        std::memcpy(row.data() + j, &v, sizeof v);
      }
      for (; j < k; ++j) row[j] = as_float(xr[j]) * inv[j];
      const float scale = std::max(abs_max(row.data(), k) / 127.f, 1e-12f);
      s[r] = scale;
      round_div_int8(row.data(), scale, q + r * k, k);
    }
  });
}

std::vector<Tensor> quantize_rows(const Tensor& x_in, const Tensor& inv) {
  const Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  Tensor s = at::empty({m, 1}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows_impl(x.data_ptr<c10::BFloat16>(), inv.data_ptr<float>(), q.data_ptr<int8_t>(),
                       s.data_ptr<float>(), m, k);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "quantize_rows: float32 or bf16 rows");
    quantize_rows_impl(x.data_ptr<float>(), inv.data_ptr<float>(), q.data_ptr<int8_t>(),
                       s.data_ptr<float>(), m, k);
  }
  return {q, s};
}

template <typename T>
void dequantize_rows_impl(const int32_t* acc, const float* s, const float* scales, T* out,
                          int64_t m, int64_t n) {
  at::parallel_for(0, m, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* ar = acc + r * n;
      T* orow = out + r * n;
      int64_t c = 0;
      for (; c + 16 <= n; c += 16) {
        i32v a;
        std::memcpy(&a, ar + c, sizeof a);
        store16(orow + c, __builtin_convertvector(a, f16v) * s[r] * load16(scales + c));
      }
      for (; c < n; ++c) store_as(orow + c, static_cast<float>(ar[c]) * s[r] * scales[c]);
    }
  });
}

Tensor dequantize_rows(const Tensor& acc_in, const Tensor& s, const Tensor& scales, bool bf16) {
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
  const Tensor acc = acc_in.contiguous();
  const int64_t m = acc.size(0), n = acc.size(1);
  Tensor out = at::empty({m, n}, acc.options().dtype(dtype));
  if (dtype == at::kBFloat16) {
    dequantize_rows_impl(acc.data_ptr<int32_t>(), s.data_ptr<float>(), scales.data_ptr<float>(),
                         out.data_ptr<c10::BFloat16>(), m, n);
  } else {
    TORCH_CHECK(dtype == at::kFloat, "dequantize_rows: float32 or bf16 out");
    dequantize_rows_impl(acc.data_ptr<int32_t>(), s.data_ptr<float>(), scales.data_ptr<float>(),
                         out.data_ptr<float>(), m, n);
  }
  return out;
}

// y = x @ w.T for a weight held in oneDNN's layout (model/quant.py's Dense.pack): torch's
// mkldnn::_linear_pointwise, which has no ATen function, through the dispatcher.
Tensor onednn_linear(const Tensor& x, const Tensor& w) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                        c10::string_view, c10::List<std::optional<at::Scalar>>,
                        std::optional<c10::string_view>)>();
  return op.call(x, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                 std::optional<c10::string_view>(""));
}

// onednn_linear over `parts` slices of x's rows at once, one thread each (oneDNN, called inside
// the parallel region, runs each on its own thread), the outputs joined. oneDNN's own threading
// of a prompt-sized GEMM is uneven: on a Xeon with AMX, 2 threads, it ran SmolLM2's qkv and down
// projections at 1,024 rows on one thread (0.71 and 1.36 ms; as two 512-row halves side by side
// 0.49 and 0.61), while gate/up and o were faster whole. model/kernel_rows.py measures which.
Tensor onednn_row_parts(const Tensor& x, const Tensor& w, int64_t parts) {
  TORCH_CHECK(x.dim() == 2 && parts >= 1, "onednn_row_parts: x (rows, K), parts >= 1");
  const int64_t m = x.size(0), per = (m + parts - 1) / parts;
  parts = (m + per - 1) / per;
  // each thread copies its part into `out` while it is in its cache (at::cat after the region
  // copied them all on one thread: ~100 us a GEMM at 1,024 rows); w's sizes are (N, K) packed.
  // Bytes, not copy_: the pool's threads are outside the caller's InferenceMode.
  Tensor out = at::empty({m, w.size(0)}, x.options());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t row_bytes = out.size(1) * out.element_size();
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t rows = std::min(per, m - i * per);
      const Tensor y = onednn_linear(x.narrow(0, i * per, rows), w).contiguous();
      std::memcpy(dst + i * per * row_bytes, y.data_ptr(), rows * row_bytes);
    }
  });
  return out;
}

// One linear layer: kind 0 dense [w]; 1 int4 [w, packed, scales_zeros]; 2 int8 [w, q, scales];
// 3 int4 in few_rows.h's layout [w, q, sz]; 4 int8 in its layout [w, q, scales].
// The quantized kernels are used up to `max_rows` input rows; from `a8_first` to `a8_last`
// rows, int8 activations [q (N, K) int8, scales (N,), inv_smooth (K,)] (model/act_quant.py,
// the same arithmetic); the dense weight otherwise (plain, or in oneDNN's layout).
struct Linear {
  int64_t kind;
  int64_t max_rows;
  std::vector<Tensor> t;
  int64_t a8_first, a8_last;
  std::vector<Tensor> a8;
  int64_t amx_from;  // kinds 3 and 4: rows from which few_rows' kernel runs on AMX tiles
  // the dense weight's row counts (of `ladder`) where its GEMM ran faster as row parts, one per
  // thread (model/quant.py `split_here`, `Dense.split_rows`): a prompt's rows, a big batch's
  std::vector<int64_t> split, ladder;

  Linear(int64_t kind, int64_t max_rows, std::vector<Tensor> t, int64_t a8_first,
         int64_t a8_last, std::vector<Tensor> a8, int64_t amx_from, std::vector<int64_t> split,
         std::vector<int64_t> ladder)
      : kind(kind),
        max_rows(max_rows),
        t(std::move(t)),
        a8_first(a8_first),
        a8_last(a8_last),
        a8(std::move(a8)),
        amx_from(amx_from),
        split(std::move(split)),
        ladder(std::move(ladder)) {}

  // quant.split_here: the ladder's counts on both sides of `rows` won (past its top, the top)
  bool split_here(int64_t rows) const {
    if (split.empty() || ladder.empty() || rows < split.front()) return false;
    int64_t below = 0, above = ladder.back();
    for (const int64_t r : ladder) {
      if (r <= rows) below = std::max(below, r);
      if (r >= rows) above = std::min(above, r);
    }
    const auto won = [&](int64_t r) { return std::find(split.begin(), split.end(), r) != split.end(); };
    return won(below) && won(above);
  }

  // exact: a prompt's rows, which keep bf16 values (model/quant.py `prompt_rows`): the
  // quantized kinds only on AMX tiles (bf16 rows times the weights unpacked to bf16, whatever
  // `amx_from`), else as the eager model takes them: int8 activations where the model has them
  // (--int8-activations on), the dense weight beyond.
  // `as_rows`: choose the kernel as for that many rows (a prompt step's last layer, which
  // carries only its sampled rows on, takes the kernel of the whole step's rows).
  Tensor operator()(const Tensor& x, bool exact = false,
                    std::optional<int64_t> as_rows = std::nullopt) const {
    const int64_t rows = as_rows.value_or(x.size(0));
    if (exact) {
      if ((kind == 3 || kind == 4) && rows <= max_rows && few_rows::amx_available())
        return kind == 3 ? few_rows::mm(x, t[1], t[2], 1) : few_rows::mm8(x, t[1], t[2], 1);
      if (a8_first <= rows && rows <= a8_last) return int8_activations(x);
      return dense(x, rows);
    }
    if (kind != 0 && rows <= max_rows) {
      if (kind == 3) return few_rows::mm(x, t[1], t[2], amx_from);
      if (kind == 4) return few_rows::mm8(x, t[1], t[2], amx_from);
      if (kind == 1) return at::_weight_int4pack_mm_for_cpu(x, t[1], 32, t[2]);
      return at::_weight_int8pack_mm(x, t[1], t[2]);
    }
    if (a8_first <= rows && rows <= a8_last) return int8_activations(x);
    return dense(x, rows);
  }

  Tensor dense(const Tensor& x, std::optional<int64_t> as_rows = std::nullopt) const {
    if (!t[0].is_mkldnn()) return at::linear(x, t[0]);
    if (x.dim() == 2 && split_here(as_rows.value_or(x.size(0))))
      return onednn_row_parts(x, t[0], at::get_num_threads());
    return onednn_linear(x, t[0]);
  }

  // As operator(), in float32 (the fused step's logits): the int8 kernel writes the same
  // values as floats rather than bf16 then a float copy.
  Tensor logits(const Tensor& x) const {
    if (kind == 4 && x.size(0) <= max_rows && x.scalar_type() == at::kBFloat16)
      return few_rows::mm8<few_rows::RoundedFloat>(x, t[1], t[2], amx_from);
    return (*this)(x).to(at::kFloat);
  }

  Tensor int8_activations(const Tensor& x) const {
    auto qs = quantize_rows(x, a8[2]);
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
                "int8 activations: float32 or bf16 rows");
    return dequantize_rows(at::_int_mm(qs[0], a8[0].t()), qs[1], a8[1],
                           x.scalar_type() == at::kBFloat16);
  }
};

// exp of 16 floats (Cephes' expf polynomial, ~1 ulp), x clamped to [-87.3, 88].
inline f16v exp_vec(f16v x) {
  const f16v lo = f16v{} - 87.3f, hi = f16v{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  f16v fx = x * 1.44269504088896341f;
  i32v n = __builtin_convertvector(fx, i32v);  // toward zero; make it a floor
  f16v nf = __builtin_convertvector(n, f16v);
  n = nf > fx ? n - 1 : n;
  nf = __builtin_convertvector(n, f16v);
  f16v r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  f16v y = f16v{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  i32v e = (n + 127) << 23;  // 2^n
  f16v scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

#if defined(__AVX512F__)
// exp_vec's arithmetic by AVX-512: its polynomial by FMAs, its floor by vrndscaleps and 2^n by
// vscalefps; a third fewer instructions (a float a bit apart from exp_vec's at times).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}
#endif

// out[r] = w * (x[r] / rms(x[r])), in float, rounded as eager: T(T(x * inv) * w). n % 16 == 0.
template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    f16v ss = f16v{};
    for (int64_t i = 0; i < n; i += 16) ss += load16(xr + i) * load16(xr + i);
    const float inv = 1.f / std::sqrt(hsum(ss) / n + eps);
    for (int64_t i = 0; i < n; i += 16)
      store16(out + r * n + i, round_vec<T>(load16(xr + i) * inv) * load16(w + i));
  }
}

// rope(x) = x * cos + swap_halves(x) * sin (sin carries rotate_half's sign), into float `out`.
template <typename T>
void rope_head(const T* x, const T* cos, const T* sin, float* out, int64_t d) {
  int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    float xc = static_cast<float>(round_to<T>(static_cast<float>(x[i]) * static_cast<float>(cos[i])));
    float sw = static_cast<float>(x[i < half ? i + half : i - half]);
    out[i] = static_cast<float>(round_to<T>(xc + sw * static_cast<float>(sin[i])));
  }
}

// In place over a row of raw q.k dot products (n valid, padded to 16): each rounded as eager's
// matmul output, scaled, softmax in float, the probabilities rounded to T; padding ends at 0.
template <typename T>
void softmax(float* s, int64_t n, float scale) {
  const int64_t padded = (n + 15) / 16 * 16;
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t t = n; t < padded; ++t) s[t] = ninf;
  f16v mx = f16v{} + ninf;
  for (int64_t t = 0; t < padded; t += 16) {
    f16v v = round_vec<T>(load16(s + t)) * scale;
    std::memcpy(s + t, &v, sizeof v);
    mx = v > mx ? v : mx;
  }
  float m = ninf;
  for (int i = 0; i < 16; ++i) m = std::max(m, mx[i]);
  f16v sum = f16v{}, seen;  // seen: 1 on the lanes of the last vector that are keys, else 0
  for (int i = 0; i < 16; ++i) seen[i] = padded - 16 + i < n ? 1.f : 0.f;
  for (int64_t t = 0; t < padded; t += 16) {
    f16v e = exp_vec(load16(s + t) - m);
    if (t + 16 > n) e *= seen;  // per lane only there: a select per lane in every vector cost
    std::memcpy(s + t, &e, sizeof e);  // a prompt's attention (its long rows) a third
    sum += e;
  }
  const float inv = 1.f / hsum(sum);
  for (int64_t t = 0; t < padded; t += 16) {
    f16v p = round_vec<T>(load16(s + t) * inv);
    std::memcpy(s + t, &p, sizeof p);
  }
}

#include "prefill_attention.h"

// Attention's unit of work: queries [q0, q1) of one kv head over a run of one sequence's rows
// (a verify step's 1 + k, else one row). Query q is row `row + q / group`'s query head
// `head * group + q % group`; a run's queries count row by row.
struct Item {
  int64_t row, head, q0, q1;
};

struct Batch {
  const int64_t* positions;  // (B,)
  const int64_t* slots;      // (B,) flat cache slot of the new token
  const int64_t* tables;     // (B, W) block ids
  const int64_t* lens;       // (B,) context length including the new token
  int64_t width;
  std::vector<Item> items;  // attention's work, in its order
  struct Run {
    int64_t row, n;
  };
  std::vector<Run> runs;  // prompt runs for the prompt attention kernel (attend_run)

  // Items of at most `tile` queries, shared out in order. A run of one sequence's rows (told
  // by their block tables and consecutive positions) goes head by head, so the later items of
  // a head read its K/V from L2: 5 rows at 1,950 tokens of context, the whole step 15.8 ->
  // 13.8 ms. Distinct sequences stay row by row (a token's heads share cache lines). A run of
  // `whole` rows or more (0: none) is one of `runs` instead: its items would each read the
  // context up to their rows, ~n^2 / 4 keys a head for n rows.
  void order_items(int64_t rows, int64_t nkv, int64_t group, int64_t tile, int64_t whole = 0) {
    items.clear();
    runs.clear();
    items.reserve(rows * nkv);
    for (int64_t r0 = 0, r1; r0 < rows; r0 = r1) {
      for (r1 = r0 + 1; r1 < rows && positions[r1] == positions[r1 - 1] + 1 &&
                        std::equal(tables + r1 * width, tables + (r1 + 1) * width,
                                   tables + r0 * width);
           ++r1) {
      }
      if (whole > 0 && r1 - r0 >= whole) {
        runs.push_back({r0, r1 - r0});
        continue;
      }
      const int64_t nq = (r1 - r0) * group, parts = (nq + tile - 1) / tile;
      for (int64_t h = 0; h < nkv; ++h)  // the run's queries in near-equal parts
        for (int64_t i = 0; i < parts; ++i)
          items.push_back({r0, h, i * nq / parts, (i + 1) * nq / parts});
    }
  }
};

// One kv head's rows of one sequence: token t at base(t) + (t % bs) * stride. The query attends
// to tokens [first, ctx): first is 0, or ctx - window for sliding-window attention.
template <typename T>
struct KV {
  const T* k;
  const T* v;
  const int64_t* table;  // the sequence's block ids
  int64_t bs, stride, offset, first, ctx;

  const T* row(const T* cache, int64_t t) const {
    return cache + (table[t / bs] * bs + t % bs) * stride + offset;
  }
};

// Software prefetch of the K (or V) row kAhead blocks on, one row per row read, while block t0
// is read from t1: a sequence's blocks lie anywhere in the cache (a decode batch's sequences
// take their new blocks in turn), and the hardware's stride prefetcher starts over at each.
// Attention alone over SmolLM2's 30 layers, blocks in random places (Zen 5, 2 threads): 1
// sequence at 1,100 tokens 3.0-4.5 -> 1.5-3.3 ms, 16 at 300 11.8 -> 8.2 ms, 64 at 300 48.7 ->
// 32.3 ms; a whole step over freshly prefilled (adjacent) blocks 2-4 % faster. One block
// ahead gained less; the next block's rows all at once at its start made steps slower.
constexpr int64_t kAhead = 2;

// The most bytes of one sequence's K and V rows (all kv heads) that a first head's attention
// item prefetches for the next items (bf16::item): four times this core's L2.
inline int64_t wide_prefetch_budget() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return 4 * static_cast<int64_t>(l2 > 0 ? l2 : 1 << 20);
  }();
  return bytes;
}

// The 8-bit cache (model/kv_int8.py): each (token, kv head) row is d int8 values, then their
// float32 scale. The attention reads half the bytes of a bf16 row, which is what a big batch's
// decode attention waits on.
constexpr int64_t kScaleBytes = 4;

// d values (the model's dtype's, as floats) into dst as kv_int8.quantize gives them: s = amax /
// 127 (1 for a row of zeros), round(x / s) half to even, both in float; s after the values.
inline void quantize_kv_row(const float* x, int8_t* dst, int64_t d) {
  float s = abs_max(x, d) / 127.f;
  if (s == 0.f) s = 1.f;
  round_div_int8(x, s, dst, d);
  std::memcpy(dst + d, &s, sizeof s);
}

inline f16v load16(const int8_t* p) {  // widened to float
#if defined(__AVX512F__)  // vpmovsxbd + vcvtdq2ps: GCC's convertvector of i8v16 goes lane by lane
  const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))));
  f16v v;
  std::memcpy(&v, &x, sizeof v);
  return v;
#else
  i8v16 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, i32v), f16v);
#endif
}

// A cache row's scale: an 8-bit row's own, after its d values; 1 for a row of the model's dtype.
template <typename C>
inline float row_scale(const C*, int64_t) {
  return 1.f;
}
inline float row_scale(const int8_t* row, int64_t d) {
  float s;
  std::memcpy(&s, row + d, sizeof s);
  return s;
}

// C: the cache's element. Rows of T are fetched as this head's; 8-bit rows (68 bytes at d = 64
// share lines) as the token's rows of every head in a sequence's first head's item, whose next
// items (its other heads, on this thread) then read theirs from cache.
template <typename C, int CH>
struct Ahead {
  const char* p = nullptr;  // the row to prefetch next (none past the context)
  int64_t stride, bytes;

  Ahead(const KV<C>& kv, const C* cache, int64_t t0, int64_t t1)
      : stride(kv.stride * static_cast<int64_t>(sizeof(C))),
        bytes(!std::is_same_v<C, int8_t> ? CH * 16 * static_cast<int64_t>(sizeof(C))
              : kv.offset == 0           ? kv.stride
                                         : CH * 16 + kScaleBytes) {
    if (t0 + kAhead * kv.bs < kv.ctx)
      p = reinterpret_cast<const char*>(kv.row(cache, t0 + kAhead * kv.bs) +
                                        (t1 - t0) * kv.stride);
  }

  void fetch(const void* row, int locality) const {  // `bytes` from row
    const char* r = static_cast<const char*>(row);
    for (int64_t b = 0; b < bytes; b += 64) {
      if (locality == 2) {
        __builtin_prefetch(r + b, 0, 2);
      } else {
        __builtin_prefetch(r + b);
      }
    }
  }

  void next() {
    if (p == nullptr) return;
    fetch(p, 3);
    p += stride;
  }
};

// The G queries of one kv head (roped, float, G * d) against their sequence's keys and values:
// scores, softmax, the weighted sum of values into dst (G * d). CH = head_dim / 16 and G are
// constants, so the queries and accumulators live in registers and each K/V row is loaded and
// widened once for the whole group. scores[g * padded + t - first] is token t's.
// C: the cache's element, T, or int8_t for the 8-bit cache (kv.stride and kv.offset in bytes
// of rows of d + 4): each key's score and each value row then times its row's scale, and the
// token's V row goes into L2 while its key is scored (without that and Ahead's rows of every
// head, the K and then the V loads held most of the kernel's samples and the step took as long
// as with bf16 rows).
template <typename T, int CH, int G, typename C>
void attend_group(const float* qf, const KV<C>& kv, float* scores, int64_t padded, float scale,
                  T* dst) {
  constexpr bool i8 = std::is_same_v<C, int8_t>;
  constexpr int64_t d = CH * 16;
  f16v q[G][CH], acc[G][CH], row[CH];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) q[g][c] = load16(qf + g * d + 16 * c);
  const int64_t start = kv.first - kv.first % kv.bs, n = kv.ctx - kv.first;
  // Block by block, no division per token; the first block from `first` on.
  for (int64_t t0 = start; t0 < kv.ctx; t0 += kv.bs) {
    const int64_t t1 = std::max(t0, kv.first);
    const C* k = kv.row(kv.k, t1);
    const C* v = kv.row(kv.v, t1);
    Ahead<C, CH> ahead(kv, kv.k, t0, t1);
    for (int64_t t = t1; t < std::min(kv.ctx, t0 + kv.bs); ++t, k += kv.stride, v += kv.stride) {
      ahead.next();
      if constexpr (i8) ahead.fetch(v, 2);
      for (int c = 0; c < CH; ++c) row[c] = load16(k + 16 * c);
      const float ks = row_scale(k, d);
      for (int g = 0; g < G; ++g) {
        f16v s = q[g][0] * row[0];
        for (int c = 1; c < CH; ++c) s += q[g][c] * row[c];
        scores[g * padded + t - kv.first] = hsum(s) * ks;
      }
    }
  }
  for (int g = 0; g < G; ++g) softmax<T>(scores + g * padded, n, scale);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = f16v{};
  for (int64_t t0 = start; t0 < kv.ctx; t0 += kv.bs) {
    const int64_t t1 = std::max(t0, kv.first);
    const C* v = kv.row(kv.v, t1);
    Ahead<C, CH> ahead(kv, kv.v, t0, t1);
    for (int64_t t = t1; t < std::min(kv.ctx, t0 + kv.bs); ++t, v += kv.stride) {
      if constexpr (!i8) ahead.next();  // 8-bit V rows are in L2 from the scores' pass
      for (int c = 0; c < CH; ++c) row[c] = load16(v + 16 * c);
      const float vs = row_scale(v, d);
      for (int g = 0; g < G; ++g) {
        const float pt = scores[g * padded + t - kv.first] * vs;
        for (int c = 0; c < CH; ++c) acc[g][c] += pt * row[c];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < CH; ++c) store16(dst + g * d + 16 * c, acc[g][c]);
}

// attend_group for any group size: the common ones as one pass, others one query at a time.
template <typename T, int CH, typename C>
void attend_heads(int64_t group, const float* qf, const KV<C>& kv, float* scores,
                  int64_t padded, float scale, T* dst) {
  switch (group) {
    case 1: return attend_group<T, CH, 1>(qf, kv, scores, padded, scale, dst);
    case 2: return attend_group<T, CH, 2>(qf, kv, scores, padded, scale, dst);
    case 3: return attend_group<T, CH, 3>(qf, kv, scores, padded, scale, dst);
    case 4: return attend_group<T, CH, 4>(qf, kv, scores, padded, scale, dst);
    default:
      for (int64_t g = 0; g < group; ++g)
        attend_group<T, CH, 1>(qf + g * CH * 16, kv, scores, padded, scale, dst + g * CH * 16);
  }
}

// A step's K or V rows (T, nkv, d) into the cache at their slots (T,): copied into a cache of
// their dtype, or quantized into an 8-bit cache's rows (quantize_kv_row), on both threads. A
// prefill chunk's 1,024 x 3 rows took torch's index_copy_ ~180 us a layer and tensor, on one
// thread; kv_int8.quantize's seven torch ops more (a 1,024-token prefill step +10 ms).
void write_kv(const Tensor& x_in, Tensor& cache, const Tensor& slots_in) {
  const Tensor x = x_in.contiguous();
  const Tensor slots = slots_in.contiguous();
  const int64_t n = x.size(0), nkv = x.size(1), d = x.size(2), width = cache.size(3);
  const bool i8 = cache.scalar_type() == at::kChar;
  TORCH_CHECK(x.dim() == 3 && cache.dim() == 4 && cache.is_contiguous() && cache.size(2) == nkv &&
                  slots.scalar_type() == at::kLong && slots.numel() == n,
              "write_kv: rows (T, nkv, d), a contiguous cache (blocks, bs, nkv, width), "
              "slots (T,)");
  TORCH_CHECK(i8 ? width == d + kScaleBytes
                 : width == d && cache.scalar_type() == x.scalar_type(),
              "write_kv: the cache holds the rows' dtype, or int8 rows of d + 4 bytes");
  TORCH_CHECK(!i8 || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "write_kv: an 8-bit cache takes bfloat16 or float32 rows");
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (!i8) {
    const int64_t bytes = nkv * d * x.element_size();
    char* dst = static_cast<char*>(cache.data_ptr());
    const char* src = static_cast<const char*>(x.data_ptr());
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        std::memcpy(dst + sp[i] * bytes, src + i * bytes, bytes);
    });
    return;
  }
  int8_t* dst = cache.data_ptr<int8_t>();
  const auto rows = [&](const auto* src) {
    at::parallel_for(0, n * nkv, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> row(d);
      for (int64_t j = begin; j < end; ++j) {
        for (int64_t i = 0; i < d; ++i) row[i] = as_float(src[j * d + i]);
        quantize_kv_row(row.data(), dst + (sp[j / nkv] * nkv + j % nkv) * width, d);
      }
    });
  };
  if (x.scalar_type() == at::kBFloat16) return rows(x.data_ptr<c10::BFloat16>());
  rows(x.data_ptr<float>());
}

#if defined(__AVX512BF16__)
// Bf16 caches where the CPU has AVX512-BF16: q.k and p.v by vdpbf16ps, 32 products of bf16 pairs
// summed into 16 floats an instruction, with no widening of K and V to float. An item's K and V
// rows are read once for all its queries: a GQA group's heads, and a verify run's rows (up to
// max_tile queries, Batch::order_items). V rows are interleaved in pairs of keys, so one
// instruction adds two keys' values times a broadcast pair of probabilities. A query's sums run
// over its dims (scores) and its keys (values) in one fixed order whatever else the item holds,
// and keys it does not see add exact zeros, so each row comes out as a step of that row alone
// gives it, bit for bit. q, k, v and the probabilities are bf16 values already (as eager rounds
// them), so every product is exact; the order of summation differs from eager's, and vdpbf16ps
// flushes values below float's normal range (2^-126) to zero.
namespace bf16 {

inline __m512bh pair(uint32_t two_bf16) { return (__m512bh)_mm512_set1_epi32(two_bf16); }

// One query's place in an item: its roped q as bf16 pairs, its keys [first, ctx), its scores
// (then probabilities, float) from key `first` on, its probabilities as bf16 from the item's
// first chunk on (key lo: the item's first key rounded down to 16; 0 outside its keys), and
// where its output goes.
struct Query {
  const c10::BFloat16* q;  // read as pairs
  float* scores;
  c10::BFloat16* p;
  int64_t first, ctx;
  c10::BFloat16* dst;
};

// The K and V rows of 16 keys from c0: in one block (its rows `stride` apart), or listed one by
// one (a chunk at the edge of the keys or of a block, a zero row for a key outside them).
struct Chunk {
  const c10::BFloat16 *k, *v;
  int64_t stride;
  const c10::BFloat16* const* kl;  // listed: 16 each
  const c10::BFloat16* const* vl;

  const c10::BFloat16* krow(int i) const { return kl ? kl[i] : k + i * stride; }
  const c10::BFloat16* vrow(int i) const { return vl ? vl[i] : v + i * stride; }
};

// Scores of one chunk of 16 keys for NQ queries, key by key: its row (loaded once for all the
// queries) times each query's, by vdpbf16ps on 32 dims at a time, then summed across lanes (a
// key's score whatever the item: each row is exact alone). Each query keeps its own keys'.
// Transposing 16 rows to score 16 keys an instruction without horizontal sums took fewer
// instructions but made 1-row steps 7-12 % slower (its bursts of 16 rows' loads).
template <int NQ>
void store_scores(const Query* qs, int64_t c0, const float (&out)[NQ][16]) {
  for (int n = 0; n < NQ; ++n) {
    const int64_t lo = std::max<int64_t>(0, qs[n].first - c0);
    const int64_t hi = std::min<int64_t>(16, qs[n].ctx - c0);
    if (lo > 0) {  // the chunk begins before the query's first key (a sliding window)
      for (int64_t i = lo; i < hi; ++i) qs[n].scores[c0 + i - qs[n].first] = out[n][i];
    } else if (hi > 0) {
      const __mmask16 keep = static_cast<__mmask16>((1u << hi) - 1);
      _mm512_mask_storeu_ps(qs[n].scores + (c0 - qs[n].first), keep, _mm512_load_ps(out[n]));
    }
  }
}

template <int NQ, int CH2>
void score_chunk(const Chunk& c, const Query* qs, int64_t c0, const char* ahead, int64_t step,
                 int64_t width) {
  __m512i q[NQ][CH2];
  for (int n = 0; n < NQ; ++n)
    for (int g = 0; g < CH2; ++g) q[n][g] = _mm512_loadu_si512(qs[n].q + 32 * g);
  alignas(64) float out[NQ][16];
  for (int i = 0; i < 16; ++i) {
    if (ahead)
      for (int64_t b = 0; b < width; b += 64) __builtin_prefetch(ahead + i * step + b);
    // this key's V row into L2 for the values after the softmax: there, the rows kAhead chunks
    // on came too late (a chunk's values take a fraction of DRAM's latency), and the V loads
    // held ~40 % of the attention's samples (perf, 64 sequences at 320 tokens, blocks in
    // random places): the step 75.4 -> 69.5 ms (interleaved, 3x), 16 sequences within noise
    for (int64_t b = 0; b < width; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(c.vrow(i)) + b, 0, 2);
    __m512i r[CH2];
    for (int g = 0; g < CH2; ++g) r[g] = _mm512_loadu_si512(c.krow(i) + 32 * g);
    for (int n = 0; n < NQ; ++n) {
      __m512 a = _mm512_setzero_ps();
      for (int g = 0; g < CH2; ++g) a = _mm512_dpbf16_ps(a, (__m512bh)r[g], (__m512bh)q[n][g]);
      out[n][i] = _mm512_reduce_add_ps(a);
    }
  }
  store_scores<NQ>(qs, c0, out);
}

// The AMX path's buffers (score_chunk_amx), one per thread.
struct Tiles {
  alignas(64) c10::BFloat16 rows[16 * 128];  // a listed chunk's K rows, packed
  alignas(64) float c[16 * 16];
  alignas(64) uint32_t q[4][16 * 16];  // B tiles: row r, column n: q_n's dims 2r, 2r + 1
};

#if defined(__AMX_BF16__)
// The scores by the tile unit where the CPU has AMX: 16 keys' rows (an A tile per 32 dims, read
// from the cache as they lie in a block) times the item's queries (B tiles loaded once per item,
// `load_queries`, in tmm2 on), all summed in C (tmm6): no per-key horizontal sums. A query's
// score of a key is its column's own sum, as above whatever else the item holds. Decode step,
// bf16 cache, ~300 tokens (interleaved medians): 64 sequences 54-56 -> 51-53 ms, 16 18.5 -> 16.8.

// (A column past the item's queries keeps an earlier item's values: its sums are never read.)
template <int NQ, int CH2>
void load_queries(const Query* qs, Tiles& t) {
  for (int h = 0; h < CH2; ++h)
    for (int r = 0; r < 16; ++r)
      for (int n = 0; n < NQ; ++n) std::memcpy(&t.q[h][r * 16 + n], qs[n].q + 32 * h + 2 * r, 4);
  few_rows::tile_load<2>(t.q[0], 64);
  if constexpr (CH2 > 1) few_rows::tile_load<3>(t.q[1], 64);
  if constexpr (CH2 > 2) few_rows::tile_load<4>(t.q[2], 64);
  if constexpr (CH2 > 3) few_rows::tile_load<5>(t.q[3], 64);
}

template <int CH2, int H = 0>
inline void score_dims(const c10::BFloat16* k, int64_t stride) {  // C += the keys' dims [32H, ..)
  if constexpr (H < CH2) {
    few_rows::tile_load<H % 2>(k + 32 * H, stride);
    few_rows::tile_dp<6, H % 2, 2 + H>();
    score_dims<CH2, H + 1>(k, stride);
  }
}

template <int NQ, int CH2>
void score_chunk_amx(const Chunk& c, const Query* qs, int64_t c0, const char* ahead,
                     int64_t step, int64_t width, Tiles& t) {
  // the prefetches of score_chunk, all before the chunk's products: the tile unit scores 16
  // keys in a few instructions, and the step then waits on memory (64 sequences at ~300 tokens:
  // ~54 % of the item's samples on these prefetches; without either, the step 5-15 % slower)
  for (int i = 0; i < 16; ++i) {
    if (ahead)
      for (int64_t b = 0; b < width; b += 64) __builtin_prefetch(ahead + i * step + b);
    for (int64_t b = 0; b < width; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(c.vrow(i)) + b, 0, 2);
  }
  const c10::BFloat16* k = c.k;
  int64_t stride = c.stride * 2;
  if (c.kl) {
    for (int i = 0; i < 16; ++i) std::memcpy(t.rows + i * CH2 * 32, c.kl[i], CH2 * 64);
    k = t.rows;
    stride = CH2 * 64;
  }
  few_rows::tile_zero<6>();
  score_dims<CH2>(k, stride);
  few_rows::tile_store<6>(t.c, 64);
  alignas(64) float out[NQ][16];
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  for (int n = 0; n < NQ; ++n)
    _mm512_store_ps(out[n], _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(n)),
                                                t.c, 4));
  store_scores<NQ>(qs, c0, out);
}
#endif

// The dims' order after unpacking a pair of rows by 16-bit words, put back: an accumulator pair
// (lo, hi) of 32 dims holds, per 128-bit lane L, dims 8L..8L+3 (lo) and 8L+4..8L+7 (hi).
inline void store_dims(c10::BFloat16* dst, __m512 lo, __m512 hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 x = _mm512_permutex2var_ps(lo, first, hi);
  const __m512 y = _mm512_permutex2var_ps(lo, second, hi);
  f16v a, b;
  std::memcpy(&a, &x, sizeof a);
  std::memcpy(&b, &y, sizeof b);
  store16(dst, a);
  store16(dst + 16, b);
}

// Values of one chunk: its keys in pairs (2i, 2i + 1), their rows interleaved by 16-bit words
// into CH2 * 2 vectors of pairs, times each query's pair of probabilities, summed in key order.
template <int NQ, int CH2>
void value_chunk(const Chunk& c, const Query* qs, int64_t off, __m512 (&acc)[NQ][CH2 * 2],
                 const char* ahead, int64_t step, int64_t width) {
  for (int i = 0; i < 16; i += 2) {
    if (ahead)
      for (int r = i; r < i + 2; ++r)
        for (int64_t b = 0; b < width; b += 64) __builtin_prefetch(ahead + r * step + b);
    __m512i pv[CH2 * 2];
    for (int g = 0; g < CH2; ++g) {
      const __m512i x = _mm512_loadu_si512(c.vrow(i) + 32 * g);
      const __m512i y = _mm512_loadu_si512(c.vrow(i + 1) + 32 * g);
      pv[2 * g] = _mm512_unpacklo_epi16(x, y);
      pv[2 * g + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int n = 0; n < NQ; ++n) {
      uint32_t two;
      std::memcpy(&two, qs[n].p + off + i, sizeof two);
      const __m512bh p = pair(two);
      for (int u = 0; u < CH2 * 2; ++u) acc[n][u] = _mm512_dpbf16_ps(acc[n][u], (__m512bh)pv[u], p);
    }
  }
}

// An item's NQ queries against one sequence's keys [first, ctx) of kv head kv.offset / d, in
// chunks of 16 from lo = first rounded down to 16: scores, each query's softmax over its own
// keys (as a row alone would have it), its probabilities as bf16 (zeros outside its keys),
// then the values into its dst.
template <int NQ, int CH2>
void item(const KV<c10::BFloat16>& kv, Query* qs, float scale, const c10::BFloat16* zero,
          Tiles* tiles) {
  const int64_t lo = kv.first / 16 * 16, hi = (kv.ctx + 15) / 16 * 16;
  const bool blocks_whole = kv.bs % 16 == 0;
  const auto whole = [&](int64_t c0) {  // in one block, every key seen
    return blocks_whole && c0 >= kv.first && c0 + 16 <= kv.ctx;
  };
  const c10::BFloat16 *kl[16], *vl[16];
  const auto chunk = [&](int64_t c0) {
    if (whole(c0)) return Chunk{kv.row(kv.k, c0), kv.row(kv.v, c0), kv.stride, nullptr, nullptr};
    for (int i = 0; i < 16; ++i) {
      const bool in = c0 + i >= kv.first && c0 + i < kv.ctx;
      kl[i] = in ? kv.row(kv.k, c0 + i) : zero;
      vl[i] = in ? kv.row(kv.v, c0 + i) : zero;
    }
    return Chunk{nullptr, nullptr, 0, kl, vl};
  };
  const int64_t step = kv.stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  // the rows kAhead chunks on (as Ahead's blocks), one prefetched per row read; none unless whole
  const auto ahead = [&](int64_t c0, const c10::BFloat16* cache) -> const char* {
    c0 += 16 * kAhead;
    return whole(c0) ? reinterpret_cast<const char*>(kv.row(cache, c0)) : nullptr;
  };
  // The prefetches' bytes a key: its rows of this head; in a sequence's first head's item, its
  // rows of every head (the items of its other heads, next on this thread, then read theirs from
  // cache): a kv head's rows are a third of each token's cache line run at SmolLM2's 3 heads,
  // and one run read whole went faster than three read a third each (64 sequences at 320
  // tokens 66 -> 62 ms a step, 16 at 1,500 47 -> 38, 4 at 4,000 28 -> 22; interleaved medians).
  // Not where a sequence's rows of every head outgrow the cache before its next item reads them.
  const int64_t width =
      kv.offset == 0 && (kv.ctx - kv.first) * step * 2 <= wide_prefetch_budget() ? step : CH2 * 64;
#if defined(__AMX_BF16__)
  if (tiles != nullptr) {
    load_queries<NQ, CH2>(qs, *tiles);
    for (int64_t c0 = lo; c0 < hi; c0 += 16)
      score_chunk_amx<NQ, CH2>(chunk(c0), qs, c0, ahead(c0, kv.k), step, width, *tiles);
  } else
#endif
  for (int64_t c0 = lo; c0 < hi; c0 += 16)
    score_chunk<NQ, CH2>(chunk(c0), qs, c0, ahead(c0, kv.k), step, width);
  for (int n = 0; n < NQ; ++n) {
    const int64_t keys = qs[n].ctx - qs[n].first, padded = (keys + 15) / 16 * 16;
    prefill::probabilities(qs[n].scores, keys, qs[n].p + (qs[n].first - lo), padded, scale);
  }
  __m512 acc[NQ][CH2 * 2];
  for (int n = 0; n < NQ; ++n)
    for (int u = 0; u < CH2 * 2; ++u) acc[n][u] = _mm512_setzero_ps();
  for (int64_t c0 = lo; c0 < hi; c0 += 16)
    value_chunk<NQ, CH2>(chunk(c0), qs, c0 - lo, acc, ahead(c0, kv.v), step, width);
  // + 0 makes a -0 sum +0: a row alone adds +0 (0 x a zero row) after its last key where a
  // run's later rows add 0 x their values, which may be -0 (flushed tiny sums keep their sign).
  const __m512 zero0 = _mm512_setzero_ps();
  for (int n = 0; n < NQ; ++n)
    for (int g = 0; g < CH2; ++g)
      store_dims(qs[n].dst + 32 * g, _mm512_add_ps(acc[n][2 * g], zero0),
                 _mm512_add_ps(acc[n][2 * g + 1], zero0));
}

// The most queries an item takes: the values' accumulators (d / 16 registers a query) within
// 24 of the 32, beside d / 16 of V pairs (at d = 128 that is 32: the compiler may spill one).
constexpr int64_t kMaxTile = 6;
constexpr int64_t max_tile(int64_t d) { return d == 128 ? 3 : kMaxTile; }

template <int CH2>
void run_item(int64_t nq, const KV<c10::BFloat16>& kv, Query* qs, float scale,
              const c10::BFloat16* zero, Tiles* tiles) {
  switch (nq) {
    case 1: return item<1, CH2>(kv, qs, scale, zero, tiles);
    case 2: return item<2, CH2>(kv, qs, scale, zero, tiles);
    case 3: return item<3, CH2>(kv, qs, scale, zero, tiles);
    case 4: return item<4, CH2>(kv, qs, scale, zero, tiles);
    case 5: return item<5, CH2>(kv, qs, scale, zero, tiles);
    case 6: return item<6, CH2>(kv, qs, scale, zero, tiles);
    default: TORCH_CHECK(false, "fused decode: an attention item of ", nq, " queries");
  }
}

// One layer's attention as `attend` holds it: qkv (roped here), RoPE tables, caches, output.
struct Layer {
  const c10::BFloat16 *src, *cos, *sin, *kc, *vc;
  c10::BFloat16* out;
  int64_t nh, nkv, d, bs, window;
  float scale;
};

// Items [begin, end) of bt: each query roped and packed as bf16 pairs, its keys (its own
// sliding window), its buffers; then the item at its size.
inline void attend_items(const Batch& bt, const Layer& l, int64_t begin, int64_t end) {
  const int64_t d = l.d, group = l.nh / l.nkv, row_len = (l.nh + 2 * l.nkv) * d;
  std::vector<c10::BFloat16> zero(d, c10::BFloat16(0.f));
  const few_rows::TileScope scope;  // the scores on AMX tiles where this process has them
  std::unique_ptr<Tiles> tiles(scope.on ? new Tiles() : nullptr);  // zeros: see load_queries
  std::vector<float> qf(d), scores;
  std::vector<c10::BFloat16> q, probs;
  for (int64_t i = begin; i < end; ++i) {
    const Item& it = bt.items[i];
    const int64_t nq = it.q1 - it.q0;
    int64_t first = std::numeric_limits<int64_t>::max(), ctx = 0;
    Query qs[kMaxTile];
    for (int64_t n = 0; n < nq; ++n) {
      const int64_t len = bt.lens[it.row + (it.q0 + n) / group];
      qs[n].first = l.window > 0 ? std::max<int64_t>(0, len - l.window) : 0;
      qs[n].ctx = len;
      first = std::min(first, qs[n].first);
      ctx = std::max(ctx, len);
    }
    const int64_t span = (ctx + 15) / 16 * 16 - first / 16 * 16 + 16;
    q.resize(nq * d);
    scores.resize(nq * span);
    probs.assign(nq * span, c10::BFloat16(0.f));
    for (int64_t n = 0; n < nq; ++n) {
      const int64_t b = it.row + (it.q0 + n) / group, p = bt.positions[b];
      const int64_t head = it.head * group + (it.q0 + n) % group;
      rope_head<c10::BFloat16>(l.src + b * row_len + head * d, l.cos + p * d, l.sin + p * d,
                               qf.data(), d);
      for (int64_t c = 0; c < d; c += 16)  // bf16 values already: stored exactly
        store16(q.data() + n * d + c, load16(qf.data() + c));
      qs[n].q = q.data() + n * d;
      qs[n].scores = scores.data() + n * span;
      qs[n].p = probs.data() + n * span;
      qs[n].dst = l.out + (b * l.nh + head) * d;
    }
    // the run's rows share their block table (Batch::order_items)
    const KV<c10::BFloat16> kv{l.kc, l.vc, bt.tables + it.row * bt.width, l.bs, l.nkv * d,
                               it.head * d, first, ctx};
    switch (d) {
      case 32: run_item<1>(nq, kv, qs, l.scale, zero.data(), tiles.get()); break;
      case 64: run_item<2>(nq, kv, qs, l.scale, zero.data(), tiles.get()); break;
      case 128: run_item<4>(nq, kv, qs, l.scale, zero.data(), tiles.get()); break;
      default: TORCH_CHECK(false, "fused decode: head_dim must be 16, 32, 64 or 128");
    }
  }
}

}  // namespace bf16
#endif

// Whether attention runs the bf16 kernel (namespace bf16): bf16 caches, head_dim >= 32, built
// where the CPU has AVX512-BF16.
inline bool bf16_items(bool bf16_cache, int64_t d) {
#if defined(__AVX512BF16__)
  return bf16_cache && d >= 32;
#else
  return false;
#endif
}

// The most queries an attention item takes (Batch::order_items): a run's queries in tiles for
// the bf16 kernel, else one row's GQA group.
inline int64_t attn_tile(bool bf16_cache, int64_t d, int64_t group) {
#if defined(__AVX512BF16__)
  if (bf16_items(bf16_cache, d)) return bf16::max_tile(d);
#endif
  return group;
}


// dst = x + delta (dst may be x), rounded as eager's add. n % 16 == 0.
template <typename T>
void add_into(T* dst, const T* x, const T* delta, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) store16(dst + i, load16(x + i) + load16(delta + i));
}

// Rows (B, n): sum = x + delta (when given; sum null: x in place), then out = RMSNorm of it * w,
// one pass a row, the rows shared between the threads where they are many (the fused step's
// at 64 rows on one thread, the other waiting, were ~1 % of a step; a prefill's:
// add_rms_norm).
template <typename T>
void add_norm_rows(T* x, const T* delta, const T* w, T* out, int64_t rows, int64_t n, float eps,
                   T* sum = nullptr) {
  T* s = sum != nullptr ? sum : x;
  at::parallel_for(0, rows, std::max<int64_t>(1, few_rows::kRowGrain / n),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (delta) add_into<T>(s + r * n, x + r * n, delta + r * n, n);
      rms_rows<T>((delta ? s : x) + r * n, w, out + r * n, 1, n, eps);
    }
  });
}

// A layer's attention parts (model/parts.py), each undefined where its family has none.
struct AttnParts {
  Tensor bias;            // ((nh + 2 nkv) d,): QKVBias
  Tensor q_norm, k_norm;  // (d,) each: HeadQKNorm
  float eps;

  AttnParts(std::optional<Tensor> bias, std::optional<Tensor> q_norm,
            std::optional<Tensor> k_norm, double eps)
      : bias(bias.value_or(Tensor())), q_norm(q_norm.value_or(Tensor())),
        k_norm(k_norm.value_or(Tensor())), eps(static_cast<float>(eps)) {
    TORCH_CHECK(this->q_norm.defined() == this->k_norm.defined(),
                "fused decode: a q norm comes with a k norm");
  }

  bool any() const { return bias.defined() || q_norm.defined(); }
};

// The parts on qkv (B, (nh + 2 nkv) d) in place, before RoPE, in parts.py's order: the bias (as
// eager's add), then RMSNorm of every q head and every k head over its d values (as Qwen3's
// q_norm/k_norm: rms_rows' rounding is parts.rms'). d % 16 == 0.
template <typename T>
void apply_parts(Tensor& qkv, const AttnParts& p, int64_t nh, int64_t nkv, int64_t d) {
  const int64_t row_len = qkv.size(1);
  for (int64_t b = 0; b < qkv.size(0); ++b) {
    T* r = qkv.data_ptr<T>() + b * row_len;
    if (p.bias.defined()) add_into<T>(r, r, p.bias.data_ptr<T>(), row_len);
    if (p.q_norm.defined()) {
      rms_rows<T>(r, p.q_norm.data_ptr<T>(), r, nh, d, p.eps);  // in place: row by row
      rms_rows<T>(r + nh * d, p.k_norm.data_ptr<T>(), r + nh * d, nkv, d, p.eps);
    }
  }
}

// RoPE on q and k, k/v written into the caches at the token's slot, then each query attends to
// its sequence's blocks (the last `window` tokens of them where window > 0, as the eager decode
// mask: keys at positions >= len - window). qkv (B, (nh + 2 nkv) d) -> out (B, nh d).
// An int8 cache (kv_int8.py) holds rows of d + kScaleBytes: its d.
inline int64_t cache_head_dim(const Tensor& cache) {
  return cache.scalar_type() == at::kChar ? cache.size(3) - kScaleBytes : cache.size(3);
}

#if defined(__AVX512BF16__)
// A prompt's run of rows (Batch::runs) by the prompt attention kernel (prefill_attention.h, as
// the eager model attends a prompt's chunk): its queries roped as the items rope them, its
// context's K and V (the run's own rows written already) gathered from the cache's blocks.
inline void attend_run(const Batch& bt, const Batch::Run& run, const c10::BFloat16* src,
                       const c10::BFloat16* cos, const c10::BFloat16* sin,
                       const c10::BFloat16* kc, const c10::BFloat16* vc, c10::BFloat16* o,
                       int64_t nh, int64_t nkv, int64_t d, int64_t bs) {
  using BF = c10::BFloat16;
  const int64_t n = run.n, ctx = bt.lens[run.row + n - 1], row_len = (nh + 2 * nkv) * d;
  const int64_t* table = bt.tables + run.row * bt.width;
  const auto bf = at::TensorOptions().dtype(at::kBFloat16);
  Tensor q = at::empty({n, nh, d}, bf), k = at::empty({ctx, nkv, d}, bf);
  Tensor v = at::empty({ctx, nkv, d}, bf);
  BF *qp = q.data_ptr<BF>(), *kp = k.data_ptr<BF>(), *vp = v.data_ptr<BF>();
  const int64_t row_bytes = nkv * d * static_cast<int64_t>(sizeof(BF));
  at::parallel_for(0, std::max(n * nh, ctx), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(d);
    for (int64_t j = begin; j < end; ++j) {
      if (j < n * nh) {
        const int64_t r = j / nh, h = j % nh, p = bt.positions[run.row + r];
        rope_head<BF>(src + (run.row + r) * row_len + h * d, cos + p * d, sin + p * d,
                      qf.data(), d);
        for (int64_t c = 0; c < d; c += 16)  // bf16 values already: stored exactly
          store16(qp + j * d + c, load16(qf.data() + c));
      }
      if (j < ctx) {
        const int64_t slot = table[j / bs] * bs + j % bs;
        std::memcpy(kp + j * nkv * d, kc + slot * nkv * d, row_bytes);
        std::memcpy(vp + j * nkv * d, vc + slot * nkv * d, row_bytes);
      }
    }
  });
  // straight into the step's output rows, not copied there after on the calling thread alone
  // (~35 MB a step of 4 x 256-token prompts; the step's time within the noise either way)
  prefill_attention_into(q, k, v, at::from_blob(o + run.row * nh * d, {n, nh, d}, bf));
}
#endif

template <typename T>
void attend(const Tensor& qkv, const Tensor& cos_t, const Tensor& sin_t, Tensor& kc, Tensor& vc,
            const Batch& bt, Tensor& out, int64_t nh, int64_t nkv, int64_t window) {
  const bool i8 = kc.scalar_type() == at::kChar;
  TORCH_CHECK(i8 || kc.scalar_type() == qkv.scalar_type(),
              "fused decode: the KV cache holds the model's dtype or int8 rows");
  const int64_t B = qkv.size(0), d = cache_head_dim(kc), bs = kc.size(1), group = nh / nkv;
  const int64_t width = kc.size(3);  // of a cache row: d values, or d int8 values and a scale
  const int64_t row_len = (nh + 2 * nkv) * d;
  const T* src = qkv.data_ptr<T>();
  const T* cos = cos_t.data_ptr<T>();
  const T* sin = sin_t.data_ptr<T>();
  T* kcp = i8 ? nullptr : kc.data_ptr<T>();
  T* vcp = i8 ? nullptr : vc.data_ptr<T>();
  int8_t* k8 = i8 ? kc.data_ptr<int8_t>() : nullptr;
  int8_t* v8 = i8 ? vc.data_ptr<int8_t>() : nullptr;
  T* o = out.data_ptr<T>();
  // write each token's k (roped) and v, both threads for many rows
  at::parallel_for(0, B * nkv, std::max<int64_t>(1, few_rows::kRowGrain / (8 * d)),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(d);
    for (int64_t j = begin; j < end; ++j) {
      const int64_t b = j / nkv, h = j % nkv;
      const T* r = src + b * row_len;
      const int64_t p = bt.positions[b];
      rope_head<T>(r + (nh + h) * d, cos + p * d, sin + p * d, tmp.data(), d);
      const T* vs = r + (nh + nkv + h) * d;
      const int64_t at_row = (bt.slots[b] * nkv + h) * width;
      if (i8) {  // the values eager quantizes: k roped (rope_head rounds to T), v as computed
        quantize_kv_row(tmp.data(), k8 + at_row, d);
        for (int64_t i = 0; i < d; ++i) tmp[i] = as_float(vs[i]);
        quantize_kv_row(tmp.data(), v8 + at_row, d);
        continue;
      }
      T* kd = kcp + at_row;
      T* vd = vcp + at_row;
      for (int64_t i = 0; i < d; ++i) {
        kd[i] = round_to<T>(tmp[i]);
        vd[i] = vs[i];
      }
    }
  });
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (const auto& run : bt.runs) attend_run(bt, run, src, cos, sin, kcp, vcp, o, nh, nkv, d, bs);
  }
#endif
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  const int64_t stride = nkv * width;  // between one token's rows of a kv head in a block
  const int64_t items = static_cast<int64_t>(bt.items.size());
  // Each item is one row's GQA group (attn_tile): its queries read the same K/V rows, which
  // stay in cache between them. C: the cache's element, T or the 8-bit cache's int8_t.
  const auto group_items = [&](const auto* kcache, const auto* vcache) {
    using C = std::remove_cv_t<std::remove_pointer_t<decltype(kcache)>>;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(group * d), scores;
      for (int64_t i = begin; i < end; ++i) {
        const Item& it = bt.items[i];
        TORCH_CHECK(it.q1 - it.q0 == group && it.q0 % group == 0,
                    "fused decode: an item of the portable attention is one row's GQA group");
        int64_t b = it.row + it.q0 / group, h = it.head, ctx = bt.lens[b], p = bt.positions[b];
        const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
        const int64_t padded = (ctx - first + 15) / 16 * 16;
        scores.resize(group * padded);
        for (int64_t g = 0; g < group; ++g)  // the group's query heads are adjacent
          rope_head<T>(src + b * row_len + (h * group + g) * d, cos + p * d, sin + p * d,
                       qf.data() + g * d, d);
        const KV<C> kv{kcache, vcache, bt.tables + b * bt.width, bs, stride, h * width, first,
                       ctx};
        T* dst = o + (b * nh + h * group) * d;
        float* sc = scores.data();
        switch (d) {  // the head size as a constant
          case 16: attend_heads<T, 1>(group, qf.data(), kv, sc, padded, scale, dst); break;
          case 32: attend_heads<T, 2>(group, qf.data(), kv, sc, padded, scale, dst); break;
          case 64: attend_heads<T, 4>(group, qf.data(), kv, sc, padded, scale, dst); break;
          case 128: attend_heads<T, 8>(group, qf.data(), kv, sc, padded, scale, dst); break;
          default: TORCH_CHECK(false, "fused decode: head_dim must be 16, 32, 64 or 128");
        }
      }
    });
  };
  if (i8) return group_items(k8, v8);  // the 8-bit rows' kernel runs items of one row's group
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_items(true, d)) {
      const bf16::Layer layer{src, cos, sin, kcp, vcp, o, nh, nkv, d, bs, window, scale};
      at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
        bf16::attend_items(bt, layer, begin, end);
      });
      return;
    }
  }
#endif
  group_items(kcp, vcp);
}

// silu(g) = g / (1 + exp(-g)) of 16 floats (exp512 with AVX-512). With the bf16 roundings
// by vcvtneps2bf16 in silu_mul, SmolLM2's gate_up of a 927-row prefill (2 threads) takes 0.38
// ms a layer against torch's silu * up 0.60 (bf16 results equal but ~2 in 10^6); 64 rows
// 0.025 against 0.039 ms.
inline f16v silu_vec(f16v g) {
#if defined(__AVX512F__)
  __m512 x;
  std::memcpy(&x, &g, sizeof x);
  x = _mm512_div_ps(x, _mm512_add_ps(exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)),
                                     _mm512_set1_ps(1.f)));
  std::memcpy(&g, &x, sizeof g);
  return g;
#else
  return g / (1.f + exp_vec(f16v{} - g));
#endif
}

// gate_up (B, 2f) -> silu(gate) * up (B, f), rounded as eager: T(T(silu(g)) * u). f % 16 == 0;
// 16 values a chunk, the chunks shared between the threads (a big batch has ~10^5 values).
template <typename T>
void silu_mul(const T* gu, T* out, int64_t rows, int64_t f) {
  const int64_t per_row = f / 16;
  at::parallel_for(0, rows * per_row, 256, [&](int64_t begin, int64_t end) {
    // (row, column) kept by increments: a division per vector took two thirds of the time
    for (int64_t j = begin, r = begin / per_row, i = (begin % per_row) * 16; j < end; ++j) {
      const f16v g = load16(gu + r * 2 * f + i), u = load16(gu + r * 2 * f + f + i);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {  // bf16 roundings by vcvtneps2bf16
        const f16v s = silu_vec(g);
        __m512 sv, uv;
        std::memcpy(&sv, &s, sizeof sv);
        std::memcpy(&uv, &u, sizeof uv);
        sv = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(sv));
        const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(sv, uv));
        std::memcpy(out + r * f + i, &o, sizeof o);
      } else
#endif
      store16(out + r * f + i, round_vec<T>(silu_vec(g)) * u);
      if ((i += 16) == f) i = 0, ++r;
    }
  });
}

// x[0, n)'s argmax as torch.argmax: the first largest value, or the first NaN where it has one.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = x[0];
  bool nan = false;
#if defined(__AVX512F__)
  if (n >= 16) {  // per lane the first largest; then the largest lane, first index
    __m512 mx = _mm512_loadu_ps(x);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = at;
    const __m512i sixteen = _mm512_set1_epi32(16);
    __mmask16 unordered = _mm512_cmp_ps_mask(mx, mx, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      at = _mm512_add_epi32(at, sixteen);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, mx, _CMP_GT_OQ);
      mx = _mm512_mask_mov_ps(mx, gt, v);
      idx = _mm512_mask_mov_epi32(idx, gt, at);
    }
    nan = unordered != 0;
    alignas(64) float mv[16];
    alignas(64) int32_t iv[16];
    _mm512_store_ps(mv, mx);
    _mm512_store_si512(iv, idx);
    top = mv[0], best = iv[0];
    for (int l = 1; l < 16; ++l)
      if (mv[l] > top || (mv[l] == top && iv[l] < best)) top = mv[l], best = iv[l];
  }
#endif
  for (; i < n && !nan; ++i) {  // the tail (or the whole row without AVX-512)
    nan = std::isnan(x[i]);
    if (x[i] > top) top = x[i], best = i;
  }
  if (nan)  // torch's argmax takes a NaN as the largest: the first one
    for (best = 0; !std::isnan(x[best]); ++best) {
    }
  return best;
}

// Each row's argmax of float logits (B, V), as torch.argmax: the first largest value, or the
// first NaN where a row has one. torch's CPU argmax reads ~6 GB/s (a 64-row step's logits,
// 12.6 MB: 1.35 ms, against 0.07 ms for their amax); this one runs both threads at vector width.
Tensor argmax_rows(const Tensor& logits_in) {
  const Tensor logits = logits_in.contiguous();
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0,
              "argmax_rows: float32 (rows, vocab)");
  const int64_t rows = logits.size(0), n = logits.size(1);
  Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(lp + r * n, n);
  });
  return out;
}

#include "sample_rows.h"

class DecodeModel {
 public:
  // norms: per layer [attn_norm, mlp_norm]; linears: per layer [qkv, o, gate_up, down]; parts:
  // per layer; window: sliding-window attention over the last `window` positions (None: all).
  DecodeModel(Tensor embed, Tensor cos, Tensor sin, std::vector<std::vector<Tensor>> norms,
              std::vector<std::vector<Linear>> linears, std::vector<AttnParts> parts,
              Tensor final_norm, Linear lm_head, std::vector<Tensor> k_caches,
              std::vector<Tensor> v_caches, int64_t num_heads, int64_t num_kv_heads, double eps,
              std::optional<int64_t> window)
      : embed_(embed), cos_(cos), sin_(sin), norms_(std::move(norms)),
        linears_(std::move(linears)), parts_(std::move(parts)), final_norm_(final_norm),
        lm_head_(std::move(lm_head)), k_(std::move(k_caches)), v_(std::move(v_caches)),
        nh_(num_heads), nkv_(num_kv_heads), eps_(static_cast<float>(eps)),
        window_(window.value_or(0)) {
    TORCH_CHECK(parts_.size() == linears_.size(), "fused decode: one AttnParts per layer");
    TORCH_CHECK(window_ >= 0, "fused decode: the sliding window must be positive");
  }

  // Logits (B, V) float32 of one decode token per sequence (of the rows `keep` names, where
  // given); writes their K/V into the caches. prompt: the rows are prompts' (Linear's exact).
  Tensor forward(Tensor ids, Tensor positions, Tensor slots, Tensor tables, Tensor lens,
                 std::optional<Tensor> keep, bool prompt) {
    at::NoGradGuard no_grad;
    Batch bt{positions.data_ptr<int64_t>(), slots.data_ptr<int64_t>(),
             tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), tables.size(1), {}};
    const int64_t d = cache_head_dim(k_[0]);
    const bool bf16_cache = k_[0].scalar_type() == at::kBFloat16;
    bt.order_items(ids.size(0), nkv_, nh_ / nkv_,  // once a step, for every layer
                   attn_tile(bf16_cache, d, nh_ / nkv_), prompt ? whole_runs(bf16_cache, d) : 0);
    Tensor x = embed_.index_select(0, ids);  // (B, hidden)
    // a prompt step's rows that sample: the only ones its last layer carries past attention
    const Tensor* rows = prompt && keep ? &*keep : nullptr;
    if (x.scalar_type() == at::kBFloat16) {
      x = layers<c10::BFloat16>(x, bt, prompt, rows);
    } else {
      TORCH_CHECK(x.scalar_type() == at::kFloat, "fused decode: float32 or bfloat16 only");
      x = layers<float>(x, bt, prompt, rows);
    }
    // the lm_head as for any row (the eager model's, too, takes a prompt's last rows so)
    if (keep) {
      if (keep->numel() == 0) return at::empty({0, 0}, x.options().dtype(at::kFloat));
      if (!rows) x = x.index_select(0, *keep);
    }
    return lm_head_.logits(x);
  }

  // Whether a prompt's run of rows attends by the prompt attention kernel here (else its rows
  // go one by one through the decode attention): model_runner.py `_fused_prompt_rows`.
  bool prompt_runs() const {
    return whole_runs(k_[0].scalar_type() == at::kBFloat16, cache_head_dim(k_[0])) > 0;
  }

 private:
  // The rows from which a prompt's run goes to the prompt attention kernel (0: never): bf16
  // caches without a sliding window (the kernel has none), on a build that has the kernel.
  int64_t whole_runs(bool bf16_cache, int64_t d) const {
    if (!bf16_cache || window_ > 0 || !bf16_items(true, d) || (d != 32 && d != 64 && d != 128))
      return 0;
    return kWholeRun;
  }
  static constexpr int64_t kWholeRun = 32;

  // The final hidden states (B, hidden), normed; with `keep` (a prompt step's rows that
  // sample), only those rows': the last layer writes every row's K/V and attends for every row,
  // then carries only the kept rows through its o projection and MLP, whose results nothing
  // else reads (4 x 256 prompt rows: ~3 of the step's ~90 GMAC). Each row's values are the
  // same either way: the linears, norms and SwiGLU compute a row alone (oneDNN's packed GEMM
  // gave the same bits at 1-16 rows as among 1,024 here, Zen 4).
  template <typename T>
  Tensor layers(Tensor x, const Batch& bt, bool prompt, const Tensor* keep = nullptr) {
    int64_t B = x.size(0);
    const int64_t n = x.size(1);
    Tensor h = at::empty_like(x);
    Tensor attn = at::empty({B, nh_ * cache_head_dim(k_[0])}, x.options());
    T* xp = x.data_ptr<T>();
    T* hp = h.data_ptr<T>();
    add_norm_rows<T>(xp, nullptr, norms_[0][0].data_ptr<T>(), hp, B, n, eps_);
    for (size_t l = 0; l < linears_.size(); ++l) {
      const auto& lin = linears_[l];
      Tensor qkv = lin[0](h, prompt).contiguous();
      if (parts_[l].any()) apply_parts<T>(qkv, parts_[l], nh_, nkv_, cache_head_dim(k_[l]));
      attend<T>(qkv, cos_, sin_, k_[l], v_[l], bt, attn, nh_, nkv_, window_);
      if (keep && l + 1 == linears_.size()) {
        if (keep->numel() == 0) return x.narrow(0, 0, 0);  // nothing samples: K/V written
        attn = attn.index_select(0, *keep);
        x = x.index_select(0, *keep);  // the residual rows (B', hidden)
        h = at::empty_like(x);
        B = x.size(0), xp = x.data_ptr<T>(), hp = h.data_ptr<T>();
      }
      const int64_t all = qkv.size(0);  // the linears choose their kernel for the step's rows
      Tensor o = lin[1](attn, prompt, all).contiguous();
      add_norm_rows<T>(xp, o.data_ptr<T>(), norms_[l][1].data_ptr<T>(), hp, B, n, eps_);
      Tensor gu = lin[2](h, prompt, all).contiguous();
      int64_t f = gu.size(1) / 2;
      Tensor act = at::empty({B, f}, x.options());
      silu_mul<T>(gu.data_ptr<T>(), act.data_ptr<T>(), B, f);
      Tensor down = lin[3](act, prompt, all).contiguous();
      const Tensor& next = l + 1 < linears_.size() ? norms_[l + 1][0] : final_norm_;
      add_norm_rows<T>(xp, down.data_ptr<T>(), next.data_ptr<T>(), hp, B, n, eps_);
    }
    return h;
  }

  Tensor embed_, cos_, sin_;
  std::vector<std::vector<Tensor>> norms_;
  std::vector<std::vector<Linear>> linears_;
  std::vector<AttnParts> parts_;
  Tensor final_norm_;
  Linear lm_head_;
  std::vector<Tensor> k_, v_;
  int64_t nh_, nkv_;
  float eps_;
  int64_t window_;  // 0: every position
};

// An eager bf16 step's SwiGLU over many rows (a prefill's; model/parts.py SwiGLU): gate_up
// (rows, 2f), each row's gate then its up, -> (rows, f) = bf16(silu(gate)) * up, rounded as
// F.silu(gate) * up. One pass instead of torch's two over a tensor out of cache (a 1,024-token
// chunk's gate_up is 6 MB a layer): SmolLM2, 927 rows, gate_up GEMM + silu * up 1.80 ms a
// layer, of which silu and mul 0.73 ms.
Tensor swiglu(const Tensor& gu_in) {
  const Tensor gu = gu_in.contiguous();
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16 && gu.dim() == 2 && gu.size(1) % 32 == 0,
              "swiglu: bf16 rows of gate then up, each a multiple of 16 wide");
  const int64_t f = gu.size(1) / 2;
  Tensor out = at::empty({gu.size(0), f}, gu.options());
  silu_mul<c10::BFloat16>(gu.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(),
                          gu.size(0), f);
  return out;
}

// The residual add and the next RMSNorm of an eager bf16 step (a prefill's; model/parts.py
// `add_rms`) in one pass over the rows: (x + delta, RMSNorm(x + delta) * w), rounded as torch's
// add then `rms_norm`. New tensors: x is left as it was.
std::vector<Tensor> add_rms_norm(const Tensor& x_in, const Tensor& d_in, const Tensor& w,
                                 double eps) {
  const Tensor x = x_in.contiguous(), delta = d_in.contiguous();
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && delta.scalar_type() == at::kBFloat16 &&
                  w.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.sizes() == delta.sizes() &&
                  x.size(1) % 16 == 0 && w.numel() == x.size(1),
              "add_rms_norm: bf16 rows and their bf16 delta, a multiple of 16 wide, and the "
              "norm's bf16 weight");
  Tensor sum = at::empty_like(x), out = at::empty_like(x);
  using BF = c10::BFloat16;
  add_norm_rows<BF>(x.data_ptr<BF>(), delta.data_ptr<BF>(), w.data_ptr<BF>(), out.data_ptr<BF>(),
                    x.size(0), x.size(1), static_cast<float>(eps), sum.data_ptr<BF>());
  return {sum, out};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_attention", [] { return bf16_items(true, 64); });  // built with AVX512-BF16
  m.def("quantize_rows", &quantize_rows, py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows", &dequantize_rows, py::call_guard<py::gil_scoped_release>());
  m.def("few_rows_mm", &few_rows::mm, py::arg("x"), py::arg("q"), py::arg("sz"),
        py::arg("amx_from") = std::numeric_limits<int64_t>::max(),
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_available", &few_rows::amx_available);
  m.def("few_rows_mm8", &few_rows::mm8<c10::BFloat16>, py::arg("x"), py::arg("q"),
        py::arg("scales"), py::arg("amx_from") = std::numeric_limits<int64_t>::max(),
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention", &prefill_attention, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("swiglu", &swiglu, py::call_guard<py::gil_scoped_release>());
  m.def("onednn_row_parts", &onednn_row_parts, py::call_guard<py::gil_scoped_release>());
  m.def("rope", &rope, py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, py::call_guard<py::gil_scoped_release>());
  m.def("sample_rows", &sample_rows, py::call_guard<py::gil_scoped_release>());
  m.def("sampling_probs", &sampling_probs, py::call_guard<py::gil_scoped_release>());
  py::class_<Linear>(m, "Linear")
      .def(py::init<int64_t, int64_t, std::vector<Tensor>, int64_t, int64_t,
                    std::vector<Tensor>, int64_t, std::vector<int64_t>, std::vector<int64_t>>());
  py::class_<AttnParts>(m, "AttnParts")
      .def(py::init<std::optional<Tensor>, std::optional<Tensor>, std::optional<Tensor>,
                    double>());
  py::class_<DecodeModel>(m, "DecodeModel")
      .def(py::init<Tensor, Tensor, Tensor, std::vector<std::vector<Tensor>>,
                    std::vector<std::vector<Linear>>, std::vector<AttnParts>, Tensor, Linear,
                    std::vector<Tensor>, std::vector<Tensor>, int64_t, int64_t, double,
                    std::optional<int64_t>>())
      .def("forward", &DecodeModel::forward, py::arg("ids"), py::arg("positions"),
           py::arg("slots"), py::arg("tables"), py::arg("lens"), py::arg("keep") = py::none(),
           py::arg("prompt") = false, py::call_guard<py::gil_scoped_release>())
      .def("prompt_runs", &DecodeModel::prompt_runs);
}
