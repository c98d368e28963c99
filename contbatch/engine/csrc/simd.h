// SIMD helpers shared by contbatch's CPU kernels (built with -march=native): CONTBATCH_AVX2 where the CPU has AVX2 +
// FMA, CONTBATCH_AVX512 where it also has AVX-512F. `Lanes8` and `Lanes16` wrap one vector register of float32 lanes
// (AVX2 and AVX-512) behind the same names, so a kernel is written once for both widths.
#pragma once
#include "tensor.h"

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONTBATCH_AVX2 1
#if defined(__AVX512F__)
#define CONTBATCH_AVX512 1
#endif
#endif

#ifdef CONTBATCH_AVX2
// 8 consecutive elements of a cache row as float32.
static inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }

static inline __m256 load8(const c10::BFloat16* x) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 8 float32 lanes rounded to bfloat16 as c10::BFloat16's conversion does (to nearest even, NaN to 0x7FC0): each
// 32-bit lane holds the bfloat16 bits in its low half.
static inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}

// 8 float32 lanes rounded to bfloat16 and widened back (exactly).
static inline __m256 round_bf16_8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }

// Stores 8 float32 lanes, as they are or rounded to bfloat16 (`bf16_bits8`).
static inline void store8(float* x, __m256 v) { _mm256_storeu_ps(x, v); }

static inline void store8(c10::BFloat16* x, __m256 v) {
  const __m256i bits = bf16_bits8(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_castsi256_si128(packed));
}

// exp for x <= 88.37 (Cephes' single-precision polynomial, ~1 ulp); lanes below -87.3 give ~0.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

// lane i of the result = the sum of the lanes of a[i]
static inline __m256 reduce8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

static inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

struct Lanes8 {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* x) { return _mm256_loadu_ps(x); }
  static V load(const c10::BFloat16* x) { return load8(x); }
  static V broadcast(const float* x) { return _mm256_broadcast_ss(x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* x, V v) { _mm256_storeu_ps(x, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V neg(V x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.f)); }
  static V exp(V x) { return exp8(x); }
  static V round_bf16(V x) { return round_bf16_8(x); }
  static void store(c10::BFloat16* x, V v) { store8(x, v); }
  static V abs(V x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), x); }
  static float max_lane(V x) { return hmax(x); }
  // bit i set iff lane i of a >= lane i of b (false for NaN)
  static uint32_t ge_mask(V a, V b) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)));
  }
  // 8 lanes, lane i the sum of the lanes of `v` congruent to i mod 8
  static __m256 fold(V v) { return v; }
  // lanes of e where x > floor, else 0
  static V keep_where_greater(V e, V x, V floor) { return _mm256_and_ps(e, _mm256_cmp_ps(x, floor, _CMP_GT_OQ)); }
};
#endif

#ifdef CONTBATCH_AVX512
// exp8 over 16 lanes.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447505531f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i pow2 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2));
}

// bf16_bits8 over 16 lanes.
static inline __m512i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
}

// 16 float32 lanes rounded to bfloat16 (to nearest even, as c10::BFloat16's conversion; a NaN stays a NaN).
static inline __m256i to_bf16_16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  return _mm512_cvtepi32_epi16(bf16_bits16(v));
#endif
}

struct Lanes16 {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* x) { return _mm512_loadu_ps(x); }
  static V load(const c10::BFloat16* x) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static V broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* x, V v) { _mm512_storeu_ps(x, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V neg(V x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
  }
  static V exp(V x) { return exp16(x); }
  static V round_bf16(V x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_16(x)), 16)); }
  static void store(c10::BFloat16* x, V v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), to_bf16_16(v)); }
  static V abs(V x) { return _mm512_abs_ps(x); }
  static float max_lane(V x) { return _mm512_reduce_max_ps(x); }
  static uint32_t ge_mask(V a, V b) { return static_cast<uint32_t>(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ)); }
  static V keep_where_greater(V e, V x, V floor) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GT_OQ), e); }
  static __m256 fold(V v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
};
#endif
