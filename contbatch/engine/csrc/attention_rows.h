// The float32-lane kernels of contbatch's CPU attention (decode_attention.cpp): a task's scores, 8 key rows at a
// time, and the sum of its value rows weighted by the probabilities, with AVX2 (`Lanes8`) or AVX-512 (`Lanes16`)
// lanes, each cache row widened to float32 as it is read.
#pragma once

#include "attention_task.h"
#include "simd.h"

#ifdef CONTBATCH_AVX2
// The scores' scale (and soft cap) applied to 8 sums, lanes >= count set to -inf.
template <typename T>
static inline __m256 finish8(__m256 s, const Task<T>& t, int64_t count) {
  s = _mm256_mul_ps(s, _mm256_set1_ps(t.scale));
  if (t.softcap > 0.f) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, s);
    for (float& x : lanes) x = t.softcap * std::tanh(x / t.softcap);
    s = _mm256_load_ps(lanes);
  }
  const __m256 valid = _mm256_cmp_ps(_mm256_set_ps(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_ps(float(count)), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, valid);
}

// The partial sums a[g][i] (S's lanes) of GN query heads against 8 key rows, each summed across its lanes and
// finished (`finish8`), head g's 8 scores stored at out + g * stride.
template <typename S, int GN, typename T>
static inline void store_scores8(const typename S::V (&a)[GN][8], const Task<T>& t, int64_t count, float* out,
                                 int64_t stride) {
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g) {
    __m256 folded[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) folded[i] = S::fold(a[g][i]);
    _mm256_storeu_ps(out + g * stride, finish8(reduce8(folded), t, count));
  }
}

// The 8 scores of each of the GN query heads q + g * dim against the key rows kr[0, 8), finished (`finish8`),
// stored at out + g * stride. Each key row is loaded once for the GN heads.
template <typename S, int GN, typename T>
static inline void scores8(const float* q, const T* const* kr, const Task<T>& t, int64_t count, float* out,
                           int64_t stride) {
  typename S::V a[GN][8];
  for (int g = 0; g < GN; ++g)
    for (int i = 0; i < 8; ++i) a[g][i] = S::zero();
  for (int64_t c = 0; c < t.dim; c += S::kWidth) {
    typename S::V qv[GN];
    for (int g = 0; g < GN; ++g) qv[g] = S::load(q + g * t.dim + c);
    for (int i = 0; i < 8; ++i) {
      const typename S::V k = S::load(kr[i] + c);
      for (int g = 0; g < GN; ++g) a[g][i] = S::fma(qv[g], k, a[g][i]);
    }
  }
  store_scores8<S>(a, t, count, out, stride);
}

// `scores8` for every query head of the task, up to 3 heads per pass over the rows with 16 lanes (1 with 8: AVX2
// has 16 registers).
template <typename S, typename T>
static inline void scores_of_rows(const Task<T>& t, const T* const* kr, int64_t count, float* out, int64_t stride) {
  for (int64_t g = 0; g < t.group;) {
    const int64_t left = t.group - g;
    if constexpr (S::kWidth == 16) {
      if (left >= 3) {
        scores8<S, 3>(t.q + g * t.dim, kr, t, count, out + g * stride, stride);
        g += 3;
        continue;
      }
      if (left == 2) {
        scores8<S, 2>(t.q + g * t.dim, kr, t, count, out + g * stride, stride);
        g += 2;
        continue;
      }
    }
    scores8<S, 1>(t.q + g * t.dim, kr, t, count, out + g * stride, stride);
    g += 1;
  }
}

// `scores_of_rows` out of line, for 8 lanes: inlined into the pipeline's and the runs' loops, GCC kept `scores8`'s
// 8 accumulators in stack slots too and stored them at every step of its loop over the columns (AVX2 has 16
// registers), which made a prefill chunk's attention 1.3-1.6x slower on a Zen 3 (docs/performance.md, "a
// sixty-sixth session"). The same arithmetic either way.
template <typename S, typename T>
static __attribute__((noinline)) void scores_of_rows_apart(const Task<T>& t, const T* const* kr, int64_t count,
                                                           float* out, int64_t stride) {
  scores_of_rows<S>(t, kr, count, out, stride);
}

// out[g][c, c + W CN) += sum over the `count` rows i of probs[g * stride + i] * vr[i][c, c + W CN), g < GN: the
// GN x CN output vectors stay in registers over the rows (independent FMA chains), each row is loaded once.
template <typename S, int GN, int CN, typename T>
static CONTBATCH_INLINE void accumulate_columns(const float* probs, int64_t stride, const T* const* vr,
                                                int64_t count, int64_t dim, int64_t c, float* out) {
  typename S::V a[GN][CN];
  for (int g = 0; g < GN; ++g)
    for (int k = 0; k < CN; ++k) a[g][k] = S::load(out + g * dim + c + S::kWidth * k);
  for (int64_t i = 0; i < count; ++i) {
    typename S::V b[GN];
    for (int g = 0; g < GN; ++g) b[g] = S::broadcast(probs + g * stride + i);
    for (int k = 0; k < CN; ++k) {
      const typename S::V v = S::load(vr[i] + c + S::kWidth * k);
      for (int g = 0; g < GN; ++g) a[g][k] = S::fma(b[g], v, a[g][k]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int k = 0; k < CN; ++k) S::store(out + g * dim + c + S::kWidth * k, a[g][k]);
}

// accumulate_columns over every column of the GN output rows, CN vectors at a time.
template <typename S, int GN, int CN, typename T>
static CONTBATCH_INLINE void accumulate_values(const float* probs, int64_t stride, const T* const* vr,
                                               int64_t count, int64_t dim, float* out) {
  int64_t c = 0;
  for (; c + S::kWidth * CN <= dim; c += S::kWidth * CN)
    accumulate_columns<S, GN, CN>(probs, stride, vr, count, dim, c, out);
  for (; c < dim; c += S::kWidth) accumulate_columns<S, GN, 1>(probs, stride, vr, count, dim, c, out);
}
#endif
