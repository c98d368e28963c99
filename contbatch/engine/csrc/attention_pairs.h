// The bfloat16-pair kernels of contbatch's CPU attention (decode_attention.cpp), for a bfloat16 cache where the CPU
// has AVX512-BF16 and head_dim is a multiple of 32: each cache row is read as raw bfloat16 pairs, 32 elements to a
// register, with no widening shuffle.
//
// Scores: `_mm512_dpbf16_ps` of the (bfloat16) query and each key row.
// Each lane adds its two products to its sum in turn (each product exact in float32), then the lanes are summed as
// the float32-lane kernel sums them (`attention_rows.h`): a score differs from that kernel's only in the order of its
// float32 additions (and in flushing denormal inputs to zero).
//
// Values: each raw register splits into its even and odd elements as float32 (a shift and a mask), and the output
// accumulates in that order ([even | odd] per 32 columns) until `unpair_rows` restores the columns' order: each
// output element is the same sum over the positions, in the same order, as `accumulate_values` computes.
#pragma once

#include <algorithm>

#include "attention_rows.h"

#if defined(CONTBATCH_AVX512) && defined(__AVX512BF16__)
#define CONTBATCH_PAIRS 1
constexpr int64_t kPairWidth = 32;

static inline __m512bh load_pairs(const c10::BFloat16* x) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(x));
}

// The 8 scores of each of the GN query heads q + g * dim (bfloat16) against the key rows kr[0, 8), finished
// (`finish8`), stored at out + g * stride.
template <int GN>
static inline void pair_scores8(const c10::BFloat16* q, const c10::BFloat16* const* kr, const Task<c10::BFloat16>& t,
                                int64_t count, float* out, int64_t stride) {
  __m512 a[GN][8];
  for (int g = 0; g < GN; ++g)
    for (int i = 0; i < 8; ++i) a[g][i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < t.dim; c += kPairWidth) {
    __m512bh qv[GN];
    for (int g = 0; g < GN; ++g) qv[g] = load_pairs(q + g * t.dim + c);
    for (int i = 0; i < 8; ++i) {
      const __m512bh k = load_pairs(kr[i] + c);
      for (int g = 0; g < GN; ++g) a[g][i] = _mm512_dpbf16_ps(a[g][i], qv[g], k);
    }
  }
  store_scores8<Lanes16>(a, t, count, out, stride);
}

// `pair_scores8` for every query head of the task, up to 3 heads per pass over the rows.
static inline void scores_of_pairs(const Task<c10::BFloat16>& t, const c10::BFloat16* q,
                                   const c10::BFloat16* const* kr, int64_t count, float* out, int64_t stride) {
  for (int64_t g = 0; g < t.group;) {
    const int64_t left = t.group - g;
    const c10::BFloat16* qg = q + g * t.dim;
    if (left >= 3) {
      pair_scores8<3>(qg, kr, t, count, out + g * stride, stride);
      g += 3;
    } else if (left == 2) {
      pair_scores8<2>(qg, kr, t, count, out + g * stride, stride);
      g += 2;
    } else {
      pair_scores8<1>(qg, kr, t, count, out + g * stride, stride);
      g += 1;
    }
  }
}

// out[g][c, c + 32 CN) (in pair order) += sum over the `count` rows i of probs[g * stride + i] * vr[i][c, c + 32 CN),
// g < GN: the GN x 2 CN output vectors stay in registers over the rows, each row is loaded once.
template <int GN, int CN>
static CONTBATCH_INLINE void accumulate_pair_columns(const float* probs, int64_t stride,
                                                     const c10::BFloat16* const* vr, int64_t count, int64_t dim,
                                                     int64_t c, float* out) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 a[GN][2 * CN];
  for (int g = 0; g < GN; ++g)
    for (int k = 0; k < 2 * CN; ++k) a[g][k] = _mm512_loadu_ps(out + g * dim + c + 16 * k);
  for (int64_t i = 0; i < count; ++i) {
    __m512 b[GN];
    for (int g = 0; g < GN; ++g) b[g] = _mm512_set1_ps(probs[g * stride + i]);
    for (int k = 0; k < CN; ++k) {
      const __m512i raw = _mm512_loadu_si512(vr[i] + c + kPairWidth * k);
      const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
      for (int g = 0; g < GN; ++g) {
        a[g][2 * k] = _mm512_fmadd_ps(b[g], even, a[g][2 * k]);
        a[g][2 * k + 1] = _mm512_fmadd_ps(b[g], odd, a[g][2 * k + 1]);
      }
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int k = 0; k < 2 * CN; ++k) _mm512_storeu_ps(out + g * dim + c + 16 * k, a[g][k]);
}

// accumulate_pair_columns over every column of the GN output rows, CN registers of pairs at a time.
template <int GN, int CN>
static CONTBATCH_INLINE void accumulate_pairs(const float* probs, int64_t stride, const c10::BFloat16* const* vr,
                                              int64_t count, int64_t dim, float* out) {
  int64_t c = 0;
  for (; c + kPairWidth * CN <= dim; c += kPairWidth * CN)
    accumulate_pair_columns<GN, CN>(probs, stride, vr, count, dim, c, out);
  for (; c < dim; c += kPairWidth) accumulate_pair_columns<GN, 1>(probs, stride, vr, count, dim, c, out);
}

// accumulate_pairs for each group of up to 4 of the task's query heads, over the value rows vr[0, count) weighted by
// probs[g * stride + i]; the task's output in pair order.
static CONTBATCH_INLINE void weigh_pairs(const Task<c10::BFloat16>& t, const float* probs, int64_t stride,
                                         const c10::BFloat16* const* vr, int64_t count) {
  for (int64_t g = 0; g < t.group; g += 4) {
    float* out = t.out + g * t.dim;
    const float* pg = probs + g * stride;
    switch (std::min<int64_t>(4, t.group - g)) {
      case 1: accumulate_pairs<1, 2>(pg, stride, vr, count, t.dim, out); break;
      case 2: accumulate_pairs<2, 2>(pg, stride, vr, count, t.dim, out); break;
      case 3: accumulate_pairs<3, 2>(pg, stride, vr, count, t.dim, out); break;
      default: accumulate_pairs<4, 1>(pg, stride, vr, count, t.dim, out); break;
    }
  }
}

// The `rows` output rows at out ([rows, dim], pair order) put back in column order.
static inline void unpair_rows(float* out, int64_t rows, int64_t dim) {
  const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i high = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  for (float* c = out; c < out + rows * dim; c += kPairWidth) {
    const __m512 even = _mm512_loadu_ps(c), odd = _mm512_loadu_ps(c + 16);
    _mm512_storeu_ps(c, _mm512_permutex2var_ps(even, low, odd));
    _mm512_storeu_ps(c + 16, _mm512_permutex2var_ps(even, high, odd));
  }
}
#endif
