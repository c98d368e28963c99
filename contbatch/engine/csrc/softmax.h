// The softmax passes of contbatch's CPU attention (decode_attention.cpp) over a row of scores whose length is a
// multiple of 8: with AVX-512, 16 lanes at a time, each lane computing what the 8-lane pass computes and the sum
// taken 8 lanes at a time in the same order, so that the results are the same bit for bit on every x86 build.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

#ifdef CONTBATCH_AVX2
// The largest of s[0, stride), stride a multiple of 8.
static inline float max_of(const float* s, int64_t stride) {
  int64_t c = 0;
#ifdef CONTBATCH_AVX512
  __m512 high16 = _mm512_set1_ps(-INFINITY);
  for (; c + 16 <= stride; c += 16) high16 = _mm512_max_ps(high16, _mm512_loadu_ps(s + c));
  float highest = _mm512_reduce_max_ps(high16);
#else
  float highest = -INFINITY;
#endif
  __m256 high = _mm256_set1_ps(-INFINITY);
  for (; c < stride; c += 8) high = _mm256_max_ps(high, _mm256_loadu_ps(s + c));
  return std::max(highest, hmax(high));
}

// s[0, stride) replaced by exp(s - top) (0 where s is -inf); returns their sum, taken 8 lanes at a time in order
// (16 lanes of exp at a time where the CPU has them: the same function, lane for lane).
static inline float exp_in_place(float* s, int64_t stride, float top) {
  __m256 sum = _mm256_setzero_ps();
  int64_t c = 0;
#ifdef CONTBATCH_AVX512
  const __m512 top16 = _mm512_set1_ps(top), none16 = _mm512_set1_ps(-INFINITY);
  for (; c + 16 <= stride; c += 16) {
    const __m512 x = _mm512_loadu_ps(s + c);
    const __m512 p = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, none16, _CMP_NEQ_OQ), exp16(_mm512_sub_ps(x, top16)));
    _mm512_storeu_ps(s + c, p);
    sum = _mm256_add_ps(sum, _mm512_castps512_ps256(p));
    sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1)));
  }
#endif
  const __m256 top8 = _mm256_set1_ps(top), none = _mm256_set1_ps(-INFINITY);
  for (; c < stride; c += 8) {
    const __m256 x = _mm256_loadu_ps(s + c);
    const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x, top8)), _mm256_cmp_ps(x, none, _CMP_NEQ_OQ));
    _mm256_storeu_ps(s + c, p);
    sum = _mm256_add_ps(sum, p);
  }
  return hsum(sum);
}

// s[0, stride) times `factor`.
static inline void scale_in_place(float* s, int64_t stride, float factor) {
  int64_t c = 0;
#ifdef CONTBATCH_AVX512
  const __m512 factor16 = _mm512_set1_ps(factor);
  for (; c + 16 <= stride; c += 16) _mm512_storeu_ps(s + c, _mm512_mul_ps(_mm512_loadu_ps(s + c), factor16));
#endif
  for (; c < stride; c += 8) _mm256_storeu_ps(s + c, _mm256_mul_ps(_mm256_loadu_ps(s + c), _mm256_set1_ps(factor)));
}

#ifdef CONTBATCH_AVX512
// exp_in_place for the AMX kernels (attention_values.h), whose probabilities are not those of the other builds
// anyway: four independent sums of 16 lanes, where exp_in_place's single chain of additions is the pass's limit.
static inline float exp_in_place16(float* s, int64_t stride, float top) {
  const __m512 top16 = _mm512_set1_ps(top), none16 = _mm512_set1_ps(-INFINITY);
  __m512 sums[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t c = 0; c < stride; c += 16) {
    const auto lanes = static_cast<__mmask16>(stride - c >= 16 ? 0xFFFF : 0xFF);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, s + c);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(lanes, x, none16, _CMP_NEQ_OQ);
    const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, top16)));
    _mm512_mask_storeu_ps(s + c, lanes, p);
    sums[(c / 16) % 4] = _mm512_add_ps(sums[(c / 16) % 4], p);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sums[0], sums[1]), _mm512_add_ps(sums[2], sums[3])));
}
#endif
#endif
