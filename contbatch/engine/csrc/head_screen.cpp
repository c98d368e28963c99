// Greedy tokens from a float32 output head without its full float32 product: an int8 screen, then float32 logits for
// the few tokens the screen cannot rule out.
//
// Head row j is W_j = s_j q_j + r_j (q_j int8 in [-127, 127], s_j = max |W_j| / 127), hidden row h = t p + e (p
// an integer in [-L, L], t = max |h| / L, for the caller's code range L: 127, or 63 where the CPU's int8 products
// sum pairs of u8 x s8 products in int16, which the unsigned codes p + 64 <= 127 keep within 2 x 127 x 127). Then
// W_j.h = s_j t (q_j.p) + s_j (q_j.e) + r_j.h, and any float32 sum of the K products W_jk h_k lies within
// gamma_K |W_j|_2 |h|_2 of W_j.h. So every float32 logit of token j lies within
//   bound_j = a_j |e|_2 + c_j |h|_2,  a_j = s_j |q_j|_2,  c_j = |r_j|_2 + gamma_K |W_j|_2,
// of approx_j = t s_j (q_j.p), whose integer product an int8 GEMM computes exactly (the caller's oneDNN product
// gives s_j (q_j.p) in float32; its rounding, and this file's, are covered by a relative margin). A token whose upper
// bound approx_j + bound_j is below the largest lower bound approx_i - bound_i cannot be the argmax of the float32
// logits in any summation order; the others get a float32 logit here (one fixed order), and the first largest wins.
//
// A bfloat16 head (its weights, and the hidden row, exact in float32) gives logits summed in float32 and rounded to
// bfloat16 once, to nearest even; rounding is monotone, so a token can be the first largest of the rounded logits only
// if its upper bound rounds at least to where the largest lower bound rounds: the screen keeps every token whose upper
// bound exceeds the bfloat16 value below that one, and compares the candidates' float32 logits rounded to bfloat16.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

constexpr float kMargin = 1e-6f;  // relative: the float32 roundings of the scaled product and of the bounds

// Rounds a non-negative double up to a float32 that is >= it.
static inline float up(double x) {
  const float f = static_cast<float>(x);
  return static_cast<double>(f) >= x ? f : std::nextafter(f, INFINITY);
}

// hidden [B, K] float32, code range L (127 or 63) -> (codes [B, K] uint8 = p + L + 1, stats [B, 3] float32: t, |e|_2
// and |h|_2, the two norms rounded up). A row that is not finite gets t = NaN, which `screen_tokens` reports as -1.
std::vector<at::Tensor> screen_quantize(const at::Tensor& hidden, int64_t levels) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous());
  TORCH_CHECK(levels == 127 || levels == 63, "screen_quantize: code range must be 127 or 63, got ", levels);
  const double range = static_cast<double>(levels);
  const int64_t rows = hidden.size(0), k = hidden.size(1);
  auto codes = at::empty({rows, k}, hidden.options().dtype(at::kByte));
  auto stats = at::empty({rows, 3}, hidden.options());
  const float* h = hidden.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* st = stats.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* x = h + b * k;
      double top = 0.0, norm = 0.0, err = 0.0;
      bool finite = true;
      for (int64_t i = 0; i < k; ++i) {
        finite = finite && std::isfinite(x[i]);
        top = std::max(top, std::fabs(static_cast<double>(x[i])));
      }
      const double t = top > 0.0 ? top / range : 1.0;
      for (int64_t i = 0; i < k; ++i) {
        const double v = x[i];
        const double p = finite ? std::clamp(std::nearbyint(v / t), -range, range) : 0.0;
        out[b * k + i] = static_cast<uint8_t>(static_cast<int>(p) + levels + 1);
        err += (v - t * p) * (v - t * p);
        norm += v * v;
      }
      st[b * 3] = finite ? static_cast<float>(t) : NAN;
      st[b * 3 + 1] = up(std::sqrt(err) * (1.0 + 1e-9));
      st[b * 3 + 2] = up(std::sqrt(norm) * (1.0 + 1e-9));
    }
  });
  return {codes, stats};
}

template <typename W>
static void quantize_rows(const W* weight, int64_t vocab, int64_t k, int8_t* codes, float* scales, float* a,
                          float* c) {
  const double eps = std::ldexp(1.0, -24), gamma = k * eps / (1 - k * eps);
  at::parallel_for(0, vocab, 64, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const W* row = weight + j * k;
      double top = 0.0;
      bool finite = true;
      for (int64_t i = 0; i < k; ++i) {
        const float v = static_cast<float>(row[i]);
        finite = finite && std::isfinite(v);
        top = std::max(top, std::fabs(static_cast<double>(v)));
      }
      if (!finite) {
        scales[j] = a[j] = c[j] = NAN;
        continue;
      }
      const double scale = up(std::max(top / 127.0, static_cast<double>(std::numeric_limits<float>::min())));
      double codes_sq = 0.0, residual_sq = 0.0, weight_sq = 0.0;
      for (int64_t i = 0; i < k; ++i) {
        const double v = static_cast<float>(row[i]);
        const double q = std::clamp(std::nearbyint(v / scale), -127.0, 127.0);
        codes[j * k + i] = static_cast<int8_t>(q);
        codes_sq += q * q;
        residual_sq += (v - scale * q) * (v - scale * q);
        weight_sq += v * v;
      }
      scales[j] = static_cast<float>(scale);
      a[j] = up(scale * std::sqrt(codes_sq) * (1.0 + 1e-9));
      c[j] = up((std::sqrt(residual_sq) + gamma * std::sqrt(weight_sq)) * (1.0 + 1e-9));
    }
  });
}

// weight [V, K] float32 or bfloat16 -> (codes [V, K] int8, scales, a, c [V] float32), in double per row (a row that
// is not finite gets NaN scale and coefficients, its codes unset):
// s_j = max |W_j| / 127 (at least the smallest normal float32) rounded up to float32, q_j = W_j / s_j rounded half to
// even and clamped to [-127, 127], r_j = W_j - s_j q_j, and the bound's a_j = s_j |q_j|_2 and c_j = |r_j|_2 +
// gamma_K |W_j|_2, each times 1 + 1e-9 and rounded up to float32.
std::vector<at::Tensor> screen_codes(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16);
  const int64_t vocab = weight.size(0), k = weight.size(1);
  auto codes = at::empty({vocab, k}, weight.options().dtype(at::kChar));
  auto options = weight.options().dtype(at::kFloat);
  auto scales = at::empty({vocab}, options), a = at::empty({vocab}, options), c = at::empty({vocab}, options);
  int8_t* q = codes.data_ptr<int8_t>();
  if (weight.scalar_type() == at::kBFloat16)
    quantize_rows(weight.data_ptr<c10::BFloat16>(), vocab, k, q, scales.data_ptr<float>(), a.data_ptr<float>(),
                  c.data_ptr<float>());
  else
    quantize_rows(weight.data_ptr<float>(), vocab, k, q, scales.data_ptr<float>(), a.data_ptr<float>(),
                  c.data_ptr<float>());
  return {codes, scales, a, c};
}

// A row's screen: approx_j = t scaled_j and bound_j = a_j err + c_j norm + kMargin |approx_j|, where err and norm
// already carry a factor 1 + kMargin (the float32 roundings of these few operations are far smaller).
struct Screen {
  const float *scaled, *a, *c;
  float t, err, norm;
  int64_t vocab;

  float bound(int64_t j, float x) const { return a[j] * err + c[j] * norm + kMargin * std::fabs(x); }
};

// Scalar tail of both passes: the largest lower bound of tokens [from, vocab), and those whose upper bound reaches
// `lower` (when `out` is given).
static float tail_pass(const Screen& s, int64_t from, float lower, std::vector<int64_t>* out) {
  float best = -INFINITY;
  for (int64_t j = from; j < s.vocab; ++j) {
    const float x = s.t * s.scaled[j], bound = s.bound(j, x);
    best = std::max(best, x - bound);
    if (out != nullptr && x + bound >= lower) out->push_back(j);
  }
  return best;
}

#ifdef CONTBATCH_AVX2
// Pass 1 over whole vectors: the largest lower bound; `done`: the tokens covered.
template <typename S>
static float vector_lower(const Screen& s, int64_t& done) {
  using V = typename S::V;
  const V t = S::set1(s.t), err = S::set1(s.err), norm = S::set1(s.norm), margin = S::set1(kMargin);
  V best = S::set1(-INFINITY);
  int64_t j = 0;
  for (; j + S::kWidth <= s.vocab; j += S::kWidth) {
    const V x = S::mul(t, S::load(s.scaled + j));
    const V bound = S::fma(S::load(s.a + j), err, S::fma(S::load(s.c + j), norm, S::mul(margin, S::abs(x))));
    best = S::max(best, S::sub(x, bound));
  }
  done = j;
  return S::max_lane(best);
}

// Pass 2 over whole vectors: appends, in order, the tokens whose upper bound reaches `lower`.
template <typename S>
static void vector_candidates(const Screen& s, float lower, std::vector<int64_t>& out) {
  using V = typename S::V;
  const V t = S::set1(s.t), err = S::set1(s.err), norm = S::set1(s.norm), margin = S::set1(kMargin);
  const V floor = S::set1(lower);
  for (int64_t j = 0; j + S::kWidth <= s.vocab; j += S::kWidth) {
    const V x = S::mul(t, S::load(s.scaled + j));
    const V bound = S::fma(S::load(s.a + j), err, S::fma(S::load(s.c + j), norm, S::mul(margin, S::abs(x))));
    for (uint32_t mask = S::ge_mask(S::add(x, bound), floor); mask != 0; mask &= mask - 1)
      out.push_back(j + __builtin_ctz(mask));
  }
}

// One float32 logit, W_j.h, in a fixed order (two chains of S's lanes, then a scalar tail); W float32 or bfloat16.
template <typename S, typename W>
static float vector_logit(const W* w, const float* h, int64_t k) {
  typename S::V a0 = S::zero(), a1 = S::zero();
  int64_t i = 0;
  for (; i + 2 * S::kWidth <= k; i += 2 * S::kWidth) {
    a0 = S::fma(S::load(w + i), S::load(h + i), a0);
    a1 = S::fma(S::load(w + i + S::kWidth), S::load(h + i + S::kWidth), a1);
  }
  float sum = hsum(S::fold(S::add(a0, a1)));
  for (; i < k; ++i) sum += static_cast<float>(w[i]) * h[i];
  return sum;
}
#endif

template <typename W>
static float logit(const W* w, const float* h, int64_t k) {
#if defined(CONTBATCH_AVX512)
  return vector_logit<Lanes16>(w, h, k);
#elif defined(CONTBATCH_AVX2)
  return vector_logit<Lanes8>(w, h, k);
#else
  float sum = 0.f;
  for (int64_t i = 0; i < k; ++i) sum += static_cast<float>(w[i]) * h[i];
  return sum;
#endif
}

// A float32 logit as the head's output holds it: itself, or rounded to bfloat16 (to nearest even, as oneDNN's and
// torch's conversions round).
static inline float as_output(float x, bool bf16) { return bf16 ? static_cast<float>(c10::BFloat16(x)) : x; }

// The largest bfloat16 value below `x` rounded to bfloat16 (-inf stays -inf).
static float bf16_below(float x) {
  const float rounded = as_output(x, true);
  if (rounded == -INFINITY) return rounded;
  uint32_t bits;
  std::memcpy(&bits, &rounded, sizeof(bits));
  bits = rounded > 0.f ? bits - 0x10000u : rounded < 0.f ? bits + 0x10000u : 0x80010000u;
  float below;
  std::memcpy(&below, &bits, sizeof(below));
  return below;
}

// The tokens of one row that the screen cannot rule out, in order; for a bfloat16 head, those whose upper bound
// exceeds the bfloat16 value below the largest lower bound's rounding.
static void candidates(const Screen& s, bool bf16, std::vector<int64_t>& out) {
  out.clear();
  int64_t done = 0;
  float lower = -INFINITY;
#if defined(CONTBATCH_AVX512)
  lower = vector_lower<Lanes16>(s, done);
#elif defined(CONTBATCH_AVX2)
  lower = vector_lower<Lanes8>(s, done);
#endif
  lower = std::max(lower, tail_pass(s, done, INFINITY, nullptr));
  if (bf16) lower = bf16_below(lower);
#if defined(CONTBATCH_AVX512)
  vector_candidates<Lanes16>(s, lower, out);
#elif defined(CONTBATCH_AVX2)
  vector_candidates<Lanes8>(s, lower, out);
#endif
  tail_pass(s, done, lower, &out);
}

// Narrows `found` with a computed logit: that of the candidate with the largest approximation, a float32 evaluation
// that some token reaches, so (as the largest lower bound did) it rules out every token whose upper bound is below it
// (for a bfloat16 head, below the bfloat16 value under its rounding). The bounds are far wider than the actual errors,
// so this cuts the window between the two passes' thresholds about in half.
template <typename W>
static void narrow(const Screen& s, const float* h, const W* w, int64_t k, bool bf16, std::vector<int64_t>& found) {
  if (found.size() < 2) return;
  int64_t top = found[0];
  for (const int64_t j : found)
    if (s.scaled[j] > s.scaled[top]) top = j;
  const float computed = logit(w + top * k, h, k), lower = bf16 ? bf16_below(computed) : computed;
  size_t kept = 0;
  for (const int64_t j : found) {
    const float x = s.t * s.scaled[j];
    if (x + s.bound(j, x) >= lower) found[kept++] = j;
  }
  found.resize(kept);
}

// The greedy token of one hidden row h: the first candidate with the largest logit (float32, or for a bfloat16 head
// rounded to bfloat16); -1 when h is not finite.
template <typename W>
static int64_t screen_row(const Screen& s, const float* h, const W* w, int64_t k, std::vector<int64_t>& found) {
  constexpr bool bf16 = std::is_same_v<W, c10::BFloat16>;
  if (!std::isfinite(s.t)) return -1;
  candidates(s, bf16, found);
  narrow(s, h, w, k, bf16, found);
  int64_t best = -1;
  float best_logit = -INFINITY;
  for (size_t i = 0; i < found.size(); ++i) {
    if (i + 1 < found.size()) {
      const W* next = w + found[i + 1] * k;
      for (int64_t d = 0; d < k; d += 64 / sizeof(W)) __builtin_prefetch(next + d, 0, 3);
    }
    const float value = as_output(logit(w + found[i] * k, h, k), bf16);
    if (best < 0 || value > best_logit) {
      best = found[i];
      best_logit = value;
    }
  }
  return best;
}

template <typename W>
static void screen_rows(const at::Tensor& scaled, const at::Tensor& stats, const at::Tensor& a,
                        const at::Tensor& c, const at::Tensor& hidden, const W* weight, int64_t* out) {
  const int64_t rows = scaled.size(0), vocab = scaled.size(1), k = hidden.size(1);
  const float *scaled_rows = scaled.data_ptr<float>(), *st = stats.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> found;
    for (int64_t b = begin; b < end; ++b) {
      const float* row = st + b * 3;
      const Screen s{scaled_rows + b * vocab, a.data_ptr<float>(), c.data_ptr<float>(), row[0],
                     row[1] * (1.f + kMargin), row[2] * (1.f + kMargin), vocab};
      out[b] = screen_row(s, hidden.data_ptr<float>() + b * k, weight, k, found);
    }
  });
}

// scaled [B, V] float32 = s_j (q_j.p_b); stats [B, 3] from `screen_quantize`; a, c [V] float32; hidden [B, K] float32
// and weight [V, K] float32 or bfloat16. Returns [B] int64: each row's greedy token, -1 where its hidden row is not
// finite.
at::Tensor screen_tokens(const at::Tensor& scaled, const at::Tensor& stats, const at::Tensor& a,
                         const at::Tensor& c, const at::Tensor& hidden, const at::Tensor& weight) {
  TORCH_CHECK(scaled.scalar_type() == at::kFloat && scaled.is_contiguous() && scaled.dim() == 2);
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && weight.is_contiguous() && hidden.is_contiguous());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16);
  const int64_t rows = scaled.size(0), vocab = scaled.size(1), k = hidden.size(1);
  TORCH_CHECK(weight.size(0) == vocab && weight.size(1) == k && a.numel() == vocab && c.numel() == vocab);
  auto tokens = at::empty({rows}, scaled.options().dtype(at::kLong));
  if (weight.scalar_type() == at::kBFloat16)
    screen_rows(scaled, stats, a, c, hidden, weight.data_ptr<c10::BFloat16>(), tokens.data_ptr<int64_t>());
  else
    screen_rows(scaled, stats, a, c, hidden, weight.data_ptr<float>(), tokens.data_ptr<int64_t>());
  return tokens;
}

// Whether the build targets a CPU with VNNI (AVX512-VNNI or AVX-VNNI): int8 products that accumulate into int32
// without the int16 saturation of older int8 instructions, at several times the float32 FMA rate.
bool has_vnni() {
#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
  return true;
#else
  return false;
#endif
}
