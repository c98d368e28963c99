// Sampling over whole rows in two passes: the draw of `Sampler._draw` / `_inverse_transform` for rows that draw over
// their whole vocabulary (plain sampling), without its intermediate tensors.
//
// Row r's probabilities are exp(s_j - max_j s_j) (exactly 0 where s_j = -inf); blocks of kBlock tokens are summed in
// float32, the running sum over blocks in float64. With u uniform in [0, 1) the target is u times the row's total
// (kept below it); the row's token is, in the first block whose running total exceeds the target, the first token
// whose running sum (float64, from the blocks before) exceeds it, or that block's last token of positive probability
// when its running sum rounds below its total. The block's probabilities are computed again there (the same code, so
// the same values) rather than stored.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

constexpr int64_t kBlock = 1024;

#ifdef CONTBATCH_AVX2
template <typename S>
static float row_max(const float* x, int64_t n) {
  typename S::V best = S::set1(-INFINITY);
  int64_t j = 0;
  for (; j + S::kWidth <= n; j += S::kWidth) best = S::max(best, S::load(x + j));
  float top = S::max_lane(best);
  for (; j < n; ++j) top = std::max(top, x[j]);
  return top;
}

// exp(x_j - top) of tokens [begin, end), -inf giving 0; into `out` when given; returns their float32 sum.
template <typename S>
static float block_weights(const float* x, int64_t begin, int64_t end, float top, float* out) {
  using V = typename S::V;
  const V shift = S::set1(top), floor = S::set1(-INFINITY);
  V sum = S::zero();
  int64_t j = begin;
  for (; j + S::kWidth <= end; j += S::kWidth) {
    const V v = S::load(x + j);
    const V e = S::keep_where_greater(S::exp(S::sub(v, shift)), v, floor);
    if (out != nullptr) S::store(out + j - begin, e);
    sum = S::add(sum, e);
  }
  float total = hsum(S::fold(sum));
  for (; j < end; ++j) {
    const float e = x[j] > -INFINITY ? std::exp(x[j] - top) : 0.f;
    if (out != nullptr) out[j - begin] = e;
    total += e;
  }
  return total;
}

template <typename S>
static int64_t draw_row(const float* x, int64_t n, double u, std::vector<double>& blocks, float* weights,
                        float* log_norm) {
  const float top = row_max<S>(x, n);
  blocks.assign((n + kBlock - 1) / kBlock, 0.0);
  double running = 0.0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const int64_t begin = static_cast<int64_t>(b) * kBlock;
    blocks[b] = running += block_weights<S>(x, begin, std::min(begin + kBlock, n), top, nullptr);
  }
  const double total = blocks.back();
  *log_norm = static_cast<float>(top + std::log(total));
  if (!(total > 0.0)) return 0;  // no token of positive probability (every score -inf): the caller's to judge
  const double target = std::min(u * total, std::nextafter(total, 0.0));
  const size_t block = std::upper_bound(blocks.begin(), blocks.end(), target) - blocks.begin();
  const int64_t begin = static_cast<int64_t>(block) * kBlock, end = std::min(begin + kBlock, n);
  block_weights<S>(x, begin, end, top, weights);
  double sum = block ? blocks[block - 1] : 0.0;
  int64_t last = begin;
  for (int64_t j = begin; j < end; ++j) {
    if (weights[j - begin] <= 0.f) continue;
    last = j;
    sum += weights[j - begin];
    if (sum > target) return j;
  }
  return last;
}
#endif

// scores [M, V] float32 contiguous (a row's maximum finite), uniforms [M] float64 in [0, 1) -> (tokens [M] int64,
// log_norm [M] float32: each row's logsumexp, the shift plus the log of the float64 total).
std::vector<at::Tensor> draw_rows(const at::Tensor& scores, const at::Tensor& uniforms) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.is_contiguous());
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.numel() == scores.size(0) &&
              uniforms.is_contiguous(), "one float64 uniform per row");
  const int64_t rows = scores.size(0), n = scores.size(1);
  TORCH_CHECK(n > 0, "rows of at least one token");
  auto tokens = at::empty({rows}, scores.options().dtype(at::kLong));
  auto log_norm = at::empty({rows}, scores.options());
  const float* x = scores.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  float* norms = log_norm.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> blocks;
    std::vector<float> weights(kBlock);
    for (int64_t r = begin; r < end; ++r) {
#if defined(CONTBATCH_AVX512)
      out[r] = draw_row<Lanes16>(x + r * n, n, u[r], blocks, weights.data(), norms + r);
#elif defined(CONTBATCH_AVX2)
      out[r] = draw_row<Lanes8>(x + r * n, n, u[r], blocks, weights.data(), norms + r);
#else
      TORCH_CHECK(false, "draw_rows needs AVX2");
#endif
    }
  });
  return {tokens, log_norm};
}

// Whether `draw_rows` is built (AVX2).
bool has_draw_rows() {
#ifdef CONTBATCH_AVX2
  return true;
#else
  return false;
#endif
}
