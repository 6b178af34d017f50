// The sampler's draw for rows that sample (engine/sampler.py `_draw`): temperature, top-k and
// top-p over float logits (B, V), one token a row by the inverse CDF, each row on its own
// thread's buffers, both threads over the rows. Included by decode.cpp after its exp and
// argmax helpers.
//
// Why: per row in torch, softmax and torch.multinomial cost ~1 ms at SmolLM2's 49,152 tokens,
// and a top-p's full sort ~4 ms: a decode step of 64 sampled rows spent 66 ms drawing
// (258 ms with top_p 0.95) beside a 45 ms model step (Xeon with AMX, 2 threads).
//
// What it computes, row by row (u in [0, 1) given per row, so a seeded request's tokens depend
// on its seed only):
//   * m = the largest logit; a row with a NaN or no finite largest logit takes the argmax
//     (torch's: the first NaN, else the first largest), as the torch path falls back to it;
//   * top-k (0 < k < V): only logits >= the k-th largest stay (ties at it stay too);
//   * weights w = exp((x - m) / T) of those, 0 for the rest and for -inf logits (masked tokens
//     are never drawn);
//   * top-p (p < 1): a token stays when the weights strictly above its own sum to less than
//     p times their total (the nucleus: the smallest set of the likeliest tokens whose mass
//     reaches p; a tie at the edge stays whole, where a sort keeps some of it in its order);
//   * the first token (in vocabulary order) whose running sum of kept weights passes u times
//     their total (the last kept one if rounding leaves none).
// Only the tokens near the top are ever sorted or selected: candidates above a threshold that
// widens until they hold k tokens (top-k) or p of the mass (top-p), so a row is a few passes
// over its V logits.
namespace sampling {

// buf = the values of x[0, n) at or above lo, in order; 16 at a time, most chunks holding none.
inline void gather_at_least(const float* x, int64_t n, float lo, std::vector<float>& buf) {
  buf.clear();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    f16v v;
    std::memcpy(&v, x + i, sizeof v);
    const i32v in = v >= lo;
    bool any = false;
    for (int l = 0; l < 16; ++l) any |= in[l] != 0;
    if (!any) continue;
    for (int l = 0; l < 16; ++l)
      if (in[l]) buf.push_back(v[l]);
  }
  for (; i < n; ++i)
    if (x[i] >= lo) buf.push_back(x[i]);
}

// The k-th largest of x[0, n) (1 <= k < n; ties counted), from candidates within d of the
// top, d widening until k are in.
inline float kth_largest(const float* x, int64_t n, int64_t k, float top, std::vector<float>& buf) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  for (float d = 8.f;; d *= 16.f) {
    const float lo = std::isfinite(top - d) ? top - d : -inf;
    gather_at_least(x, n, lo, buf);
    if (static_cast<int64_t>(buf.size()) >= k) {
      std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<float>());
      return buf[k - 1];
    }
    if (lo == -inf) return lo;  // fewer than k above -inf
  }
}

// The smallest kept weight under top-p: weights w[0, n) (>= 0, the largest 1), their total
// `total`; candidates above eps, eps falling until they hold p of the mass, sorted.
inline float nucleus_floor(const float* w, int64_t n, double total, float p,
                           std::vector<float>& buf) {
  const double want = p * total;
  for (float eps = 1.f / 16;; eps = eps > 1e-30f ? eps / 256 : 0.f) {
    gather_at_least(w, n, std::max(eps, std::numeric_limits<float>::denorm_min()), buf);
    double mass = 0;
    for (const float v : buf) mass += v;
    if (mass < want && eps > 0.f) continue;
    std::sort(buf.begin(), buf.end(), std::greater<float>());
    float floor = buf.empty() ? 1.f : buf[0];
    double above = 0;  // the kept weights strictly above the next group of equal ones
    for (size_t j = 0; j < buf.size() && above < want;) {
      floor = buf[j];
      for (; j < buf.size() && buf[j] == floor; ++j) above += buf[j];
    }
    return floor;
  }
}

// A row's weights w[0, n) (see the top of this file) and the smallest kept one, `floor`
// (weights below it are dropped), with the kept ones' total; false for a row with a NaN or no
// finite largest logit.
struct Kept {
  float floor;
  double total;
};

inline bool weights(const float* x, int64_t n, float temperature, int64_t k, float p,
                    std::vector<float>& w, std::vector<float>& buf, Kept& kept) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  const float top = x[argmax_row(x, n)];  // a NaN where the row has one
  if (!std::isfinite(top)) return false;
  const float lo = k > 0 && k < n ? kth_largest(x, n, k, top, buf) : -inf;
  const float inv_t = 1.f / temperature;
  w.resize((n + 15) / 16 * 16);
  double total = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    f16v v;
    std::memcpy(&v, x + i, sizeof v);
    const auto keep = (v >= lo) & (v > -inf);
    f16v e = exp_vec((v - top) * inv_t);
    e = keep ? e : f16v{};
    std::memcpy(w.data() + i, &e, sizeof e);
    total += hsum(e);
  }
  for (; i < n; ++i) {
    w[i] = x[i] >= lo && x[i] > -inf ? std::exp((x[i] - top) * inv_t) : 0.f;
    total += w[i];
  }
  float floor = std::numeric_limits<float>::denorm_min();  // every weight that is not 0
  if (p < 1.f) {
    floor = nucleus_floor(w.data(), n, total, p, buf);
    total = 0;
    for (int64_t j = 0; j < n; ++j) total += w[j] >= floor ? w[j] : 0.f;
  }
  kept = {floor, total};
  return true;
}

// One row: its token (see the top of this file).
inline int64_t draw(const float* x, int64_t n, float temperature, int64_t k, float p, double u,
                    std::vector<float>& w, std::vector<float>& buf) {
  Kept kept;
  if (!weights(x, n, temperature, k, p, w, buf, kept)) return argmax_row(x, n);
  const float floor = kept.floor;
  const double target = u * kept.total;
  double run = 0;
  int64_t last = 0;  // the last block with a kept token (the largest logit is kept)
  for (int64_t j0 = 0; j0 < n; j0 += 16) {  // 16 weights at a time, then the one that passes
    const int64_t j1 = std::min(n, j0 + 16);
    float block = 0;
    if (j1 - j0 == 16) {
      f16v e;
      std::memcpy(&e, w.data() + j0, sizeof e);
      block = hsum(e >= floor ? e : f16v{});
    } else {
      for (int64_t j = j0; j < j1; ++j) block += w[j] >= floor ? w[j] : 0.f;
    }
    if (block == 0.f) continue;
    last = j0;
    if (run + block <= target) {
      run += block;
      continue;
    }
    for (int64_t j = j0; j < j1; ++j)
      if (w[j] >= floor && (run += w[j]) > target) return j;
  }
  int64_t j = std::min(n, last + 16) - 1;  // rounding past the end: the last kept token
  while (w[j] < floor) --j;
  return j;
}

// The per-row settings both entry points take, checked: temperature (rows,) float32 > 0, top_k
// (rows,) int64 (0: off), top_p (rows,) float32 in (0, 1]; the tensors held while in use.
struct Settings {
  Tensor t, k, p;
  const float *temperature, *top_p;
  const int64_t* top_k;

  Settings(const char* who, int64_t rows, const Tensor& t_in, const Tensor& k_in,
           const Tensor& p_in)
      : t(t_in.contiguous()), k(k_in.contiguous()), p(p_in.contiguous()) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && k.scalar_type() == at::kLong &&
                    p.scalar_type() == at::kFloat && t.numel() == rows && k.numel() == rows &&
                    p.numel() == rows,
                who, ": temperature (rows,) float32, top_k (rows,) int64, top_p (rows,) float32");
    temperature = t.data_ptr<float>(), top_p = p.data_ptr<float>(), top_k = k.data_ptr<int64_t>();
  }
};

inline Tensor checked_logits(const char* who, const Tensor& logits_in) {
  const Tensor logits = logits_in.contiguous();
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0,
              who, ": float32 logits (rows, vocab)");
  return logits;
}

}  // namespace sampling

// Rows of float logits (B, V) -> a token each (B,), int64, at uniforms u (B,) float64 in [0, 1).
Tensor sample_rows(const Tensor& logits_in, const Tensor& temperature, const Tensor& top_k,
                   const Tensor& top_p, const Tensor& u_in) {
  const Tensor logits = sampling::checked_logits("sample_rows", logits_in), u = u_in.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  const sampling::Settings s("sample_rows", rows, temperature, top_k, top_p);
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.numel() == rows,
              "sample_rows: u (rows,) float64");
  Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w, buf;
    for (int64_t r = begin; r < end; ++r)
      op[r] = sampling::draw(lp + r * n, n, s.temperature[r], s.top_k[r], s.top_p[r], up[r], w,
                             buf);
  });
  return out;
}

// The distributions sample_rows draws from, as probabilities (R, V) float32: each row's kept
// weights over their total, 0 elsewhere; NaN all along a row sample_rows gives the argmax.
// For speculation's verify (engine/spec_decode.py), which needs the target's p at its drafts
// and the rest of it (per row in torch, a top-p's sort took ~4 ms: 20 ms a verify of 4 drafts).
Tensor sampling_probs(const Tensor& logits_in, const Tensor& temperature, const Tensor& top_k,
                      const Tensor& top_p) {
  const Tensor logits = sampling::checked_logits("sampling_probs", logits_in);
  const int64_t rows = logits.size(0), n = logits.size(1);
  const sampling::Settings s("sampling_probs", rows, temperature, top_k, top_p);
  Tensor out = at::empty({rows, n}, logits.options());
  const float* lp = logits.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w, buf;
    for (int64_t r = begin; r < end; ++r) {
      float* o = op + r * n;
      sampling::Kept kept;
      if (!sampling::weights(lp + r * n, n, s.temperature[r], s.top_k[r], s.top_p[r], w, buf,
                             kept)) {
        std::fill(o, o + n, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const float inv = static_cast<float>(1.0 / kept.total);
      for (int64_t j = 0; j < n; ++j) o[j] = w[j] >= kept.floor ? w[j] * inv : 0.f;
    }
  });
  return out;
}
