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
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "screen_logits.h"
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

// Pass 1's result over a row: the largest lower bound approx_j - bound_j, and the largest scaled product.
struct Extremes {
  float lower = -INFINITY, top = -INFINITY;
};

// Scalar tail of pass 1, over tokens [from, vocab).
static void tail_extremes(const Screen& s, int64_t from, Extremes& e) {
  for (int64_t j = from; j < s.vocab; ++j) {
    const float x = s.t * s.scaled[j];
    e.lower = std::max(e.lower, x - s.bound(j, x));
    e.top = std::max(e.top, s.scaled[j]);
  }
}

// Scalar tail of pass 2: appends the tokens of [from, vocab) whose upper bound reaches `floor`.
static void tail_candidates(const Screen& s, int64_t from, float floor, std::vector<int64_t>& out) {
  for (int64_t j = from; j < s.vocab; ++j) {
    const float x = s.t * s.scaled[j];
    if (x + s.bound(j, x) >= floor) out.push_back(j);
  }
}

#ifdef CONTBATCH_AVX2
// Pass 1 over whole vectors; `done`: the tokens covered.
template <typename S>
static Extremes vector_extremes(const Screen& s, int64_t& done) {
  using V = typename S::V;
  const V t = S::set1(s.t), err = S::set1(s.err), norm = S::set1(s.norm), margin = S::set1(kMargin);
  V best = S::set1(-INFINITY), top = best;
  int64_t j = 0;
  for (; j + S::kWidth <= s.vocab; j += S::kWidth) {
    const V scaled = S::load(s.scaled + j), x = S::mul(t, scaled);
    const V bound = S::fma(S::load(s.a + j), err, S::fma(S::load(s.c + j), norm, S::mul(margin, S::abs(x))));
    best = S::max(best, S::sub(x, bound));
    top = S::max(top, scaled);
  }
  done = j;
  return {S::max_lane(best), S::max_lane(top)};
}

// Pass 2 over whole vectors: appends, in order, the tokens whose upper bound reaches `floor`.
template <typename S>
static void vector_candidates(const Screen& s, float floor, std::vector<int64_t>& out) {
  using V = typename S::V;
  const V t = S::set1(s.t), err = S::set1(s.err), norm = S::set1(s.norm), margin = S::set1(kMargin);
  const V least = S::set1(floor);
  for (int64_t j = 0; j + S::kWidth <= s.vocab; j += S::kWidth) {
    const V x = S::mul(t, S::load(s.scaled + j));
    const V bound = S::fma(S::load(s.a + j), err, S::fma(S::load(s.c + j), norm, S::mul(margin, S::abs(x))));
    for (uint32_t mask = S::ge_mask(S::add(x, bound), least); mask != 0; mask &= mask - 1)
      out.push_back(j + __builtin_ctz(mask));
  }
}

// The first token whose scaled product is `value`, the largest (-1 when none is).
template <typename S>
static int64_t vector_first_top(const Screen& s, float value) {
  const typename S::V target = S::set1(value);
  int64_t j = 0;
  for (; j + S::kWidth <= s.vocab; j += S::kWidth)
    if (const uint32_t mask = S::ge_mask(S::load(s.scaled + j), target)) return j + __builtin_ctz(mask);
  for (; j < s.vocab; ++j)
    if (s.scaled[j] >= value) return j;
  return -1;
}
#endif

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

// The first token with the largest scaled product (-1 when none is: a row of NaN).
static int64_t first_top(const Screen& s, float value) {
#if defined(CONTBATCH_AVX512)
  return vector_first_top<Lanes16>(s, value);
#elif defined(CONTBATCH_AVX2)
  return vector_first_top<Lanes8>(s, value);
#else
  for (int64_t j = 0; j < s.vocab; ++j)
    if (s.scaled[j] >= value) return j;
  return -1;
#endif
}

// The tokens of one hidden row h that the screen cannot rule out, in order: those whose upper bound reaches the
// largest lower bound and the float32 logit of the token with the largest approximation (a value some token reaches,
// which rules out about nine in ten of the tokens the lower bound leaves); for a bfloat16 head, the bfloat16 value
// below the larger one's rounding.
template <typename W>
static void candidates(const Screen& s, const float* h, const W* w, int64_t k, std::vector<int64_t>& out) {
  out.clear();
  int64_t done = 0;
  Extremes e;
#if defined(CONTBATCH_AVX512)
  e = vector_extremes<Lanes16>(s, done);
#elif defined(CONTBATCH_AVX2)
  e = vector_extremes<Lanes8>(s, done);
#endif
  tail_extremes(s, done, e);
  float floor = e.lower;
  if (const int64_t top = first_top(s, e.top); top >= 0) floor = std::max(floor, logit(w + top * k, h, k));
  if (std::is_same_v<W, c10::BFloat16>) floor = bf16_below(floor);
#if defined(CONTBATCH_AVX512)
  vector_candidates<Lanes16>(s, floor, out);
#elif defined(CONTBATCH_AVX2)
  vector_candidates<Lanes8>(s, floor, out);
#endif
  tail_candidates(s, done, floor, out);
}

// Each row's candidates, in token order; an empty list for a row whose hidden row is not finite. Rows are taken one at
// a time by the next free thread: their candidates number from one to thousands.
template <typename W>
static std::vector<std::vector<int64_t>> row_candidates(const at::Tensor& scaled, const at::Tensor& stats,
                                                        const at::Tensor& a, const at::Tensor& c,
                                                        const at::Tensor& hidden, const W* weight) {
  const int64_t rows = scaled.size(0), vocab = scaled.size(1), k = hidden.size(1);
  const float *scaled_rows = scaled.data_ptr<float>(), *st = stats.data_ptr<float>();
  std::vector<std::vector<int64_t>> found(rows);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(rows, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (int64_t b = next++; b < rows; b = next++) {
      const float* row = st + b * 3;
      const Screen s{scaled_rows + b * vocab, a.data_ptr<float>(), c.data_ptr<float>(), row[0],
                     row[1] * (1.f + kMargin), row[2] * (1.f + kMargin), vocab};
      if (std::isfinite(s.t)) candidates(s, hidden.data_ptr<float>() + b * k, weight, k, found[b]);
    }
  });
  return found;
}

// Each row's greedy token: the first of its candidates with the largest logit (float32, or for a bfloat16 head
// rounded to bfloat16); -1 for a row without candidates (its hidden row is not finite).
template <typename W>
static void screen_rows(const at::Tensor& scaled, const at::Tensor& stats, const at::Tensor& a,
                        const at::Tensor& c, const at::Tensor& hidden, const W* weight, int64_t* out) {
  const int64_t k = hidden.size(1);
  const auto found = row_candidates(scaled, stats, a, c, hidden, weight);
  const TokenGroups groups = group_by_token(found, scaled.size(1));
  const std::vector<float> values = candidate_logits(groups, hidden.data_ptr<float>(), weight, k);
  for (size_t b = 0; b < found.size(); ++b) {
    int64_t best = -1;
    float best_logit = -INFINITY;
    for (size_t i = 0; i < found[b].size(); ++i) {
      const float value = values[groups.offsets[b] + static_cast<int64_t>(i)];
      if (best < 0 || value > best_logit) {
        best = found[b][i];
        best_logit = value;
      }
    }
    out[b] = best;
  }
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
