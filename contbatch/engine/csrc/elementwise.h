// Helpers of the elementwise kernels that round as PyTorch's ops round (fused_ops.cpp, rope.cpp): values widened to
// float32, computed, and rounded to the tensor's dtype (float32 or bfloat16) where the module's own ops round.
#pragma once
#include <type_traits>

#include "simd.h"

// Elements a thread takes at least, in these kernels' `at::parallel_for` loops.
constexpr int64_t kGrainElements = 16384;

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

// x rounded to T and widened back (a no-op for float32).
template <typename T>
inline float round_to(float x) {
  return widen(static_cast<T>(x));
}

#ifdef CONTBATCH_AVX2
#ifdef CONTBATCH_AVX512
using Lanes = Lanes16;
#else
using Lanes = Lanes8;
#endif

// Every lane rounded to T and widened back.
template <typename T>
inline Lanes::V round_to(Lanes::V v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return Lanes::round_bf16(v);
  }
}
#endif
