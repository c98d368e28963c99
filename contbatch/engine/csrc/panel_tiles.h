// The register tiles of the panel kernel (panel_gemm.cpp, which states the layouts and the arithmetic): float32 panels
// in 6 x 16 tiles (AVX2) or 6 x 32 (AVX-512, two panels), bfloat16 panels widened as they load, and bfloat16 panels in
// k pairs through `vdpbf16ps` (AVX512-BF16, up to 8 x 48). Included by panel_gemm.cpp only.
#pragma once
#include "tensor.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kTileRows = 6;

// Runs BODY(r) for the tile's rows r < R; BODY names row r's accumulators c<r>0 and c<r>1. Named accumulators, not
// arrays: GCC keeps arrays of __m256 in memory and stores them at every k.
#define CONTBATCH_TILE_ROWS(BODY) \
  BODY(0)                         \
  if constexpr (R > 1) { BODY(1) } \
  if constexpr (R > 2) { BODY(2) } \
  if constexpr (R > 3) { BODY(3) } \
  if constexpr (R > 4) { BODY(4) } \
  if constexpr (R > 5) { BODY(5) }

// Line k of a panel as two float32 vectors (its 16 columns).
inline void load_line(const float* line, __m256& b0, __m256& b1) {
  b0 = _mm256_loadu_ps(line);
  b1 = _mm256_loadu_ps(line + 8);
}

// A bfloat16 line is stored interleaved (columns 0, 8, 1, 9, ..., 7, 15: `pack_panels`), so that the low halves of its
// eight 32-bit words are columns 0-7 and the high halves columns 8-15: one shift and one mask widen it.
inline void load_line(const uint16_t* line, __m256& b0, __m256& b1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  b0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  b1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// One R x 16 tile over k in [0, kc): x points at the tile's first row at its first k (rows ldx apart), panel at the
// panel's line for that k, y at the tile's outputs (rows ldy apart, ncols of the 16 columns real). With `resume` the
// accumulators start from the partial sums in y, else from zero; with `finish` the bias is added, else y receives
// partial sums for a later chunk of k. Either way each output stays one FMA chain over k in order.
template <int R, typename P>
inline void tile(const float* x, int64_t ldx, int64_t kc, const P* panel, int64_t, float* y, int64_t ldy,
                 int64_t ncols, const float* bias, bool resume, bool finish) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(ncols)), lane);
  const __m256i high = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(ncols) - 8), lane);
  const __m256 zero = _mm256_setzero_ps();
  const float *x0 = x, *x1 = x + std::min(1, R - 1) * ldx, *x2 = x + std::min(2, R - 1) * ldx;
  const float *x3 = x + std::min(3, R - 1) * ldx, *x4 = x + std::min(4, R - 1) * ldx, *x5 = x + (R - 1) * ldx;
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define CONTBATCH_START(r)                                                   \
  c##r##0 = resume ? _mm256_maskload_ps(y + r * ldy, low) : zero;            \
  c##r##1 = resume ? _mm256_maskload_ps(y + r * ldy + 8, high) : zero;
  CONTBATCH_TILE_ROWS(CONTBATCH_START)
  for (int64_t k = 0; k < kc; ++k) {
    __m256 b0, b1;
    load_line(panel + k * kPanel, b0, b1);
#define CONTBATCH_FMA(r)                                \
  {                                                     \
    const __m256 a = _mm256_broadcast_ss(x##r + k);     \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);          \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);          \
  }
    CONTBATCH_TILE_ROWS(CONTBATCH_FMA)
  }
  const __m256 d0 = finish && bias ? _mm256_maskload_ps(bias, low) : zero;
  const __m256 d1 = finish && bias ? _mm256_maskload_ps(bias + 8, high) : zero;
#define CONTBATCH_STORE(r)                                                  \
  _mm256_maskstore_ps(y + r * ldy, low, _mm256_add_ps(c##r##0, d0));        \
  _mm256_maskstore_ps(y + r * ldy + 8, high, _mm256_add_ps(c##r##1, d1));
  CONTBATCH_TILE_ROWS(CONTBATCH_STORE)
#undef CONTBATCH_START
#undef CONTBATCH_FMA
#undef CONTBATCH_STORE
}

// A tile function: (x, ldx, k steps, panel, stride between the task's panels, y, ldy, ncols, bias, resume, finish).
template <typename X, typename P>
using TileFn = void (*)(const X*, int64_t, int64_t, const P*, int64_t, float*, int64_t, int64_t, const float*, bool,
                        bool);
template <typename P>
constexpr TileFn<float, P> kTiles[kTileRows + 1] = {nullptr, tile<1, P>, tile<2, P>, tile<3, P>, tile<4, P>,
                                                    tile<5, P>, tile<6, P>};

#if defined(__AVX512F__)
// One R x 32 tile over two adjacent float32 panels (the second `stride` floats after the first; ncols of the 32
// columns real, at least 17): per k, one 16-lane load of each panel's line and R broadcasts feed 2R FMAs into 2R
// AVX-512 registers. Otherwise as `tile`: each output one FMA chain over k in order, whatever the tile.
template <int R>
inline void wide_tile(const float* x, int64_t ldx, int64_t kc, const float* panel, int64_t stride, float* y,
                      int64_t ldy, int64_t ncols, const float* bias, bool resume, bool finish) {
  const __mmask16 high = static_cast<__mmask16>((1u << (ncols - kPanel)) - 1u);
  const float *x0 = x, *x1 = x + std::min(1, R - 1) * ldx, *x2 = x + std::min(2, R - 1) * ldx;
  const float *x3 = x + std::min(3, R - 1) * ldx, *x4 = x + std::min(4, R - 1) * ldx, *x5 = x + (R - 1) * ldx;
  __m512 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define CONTBATCH_START(r)                                                      \
  c##r##0 = resume ? _mm512_loadu_ps(y + r * ldy) : _mm512_setzero_ps();        \
  c##r##1 = resume ? _mm512_maskz_loadu_ps(high, y + r * ldy + kPanel) : _mm512_setzero_ps();
  CONTBATCH_TILE_ROWS(CONTBATCH_START)
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(panel + k * kPanel), b1 = _mm512_loadu_ps(panel + stride + k * kPanel);
#define CONTBATCH_FMA(r)                              \
  {                                                   \
    const __m512 a = _mm512_set1_ps(x##r[k]);         \
    c##r##0 = _mm512_fmadd_ps(a, b0, c##r##0);        \
    c##r##1 = _mm512_fmadd_ps(a, b1, c##r##1);        \
  }
    CONTBATCH_TILE_ROWS(CONTBATCH_FMA)
  }
  const __m512 d0 = finish && bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 d1 = finish && bias ? _mm512_maskz_loadu_ps(high, bias + kPanel) : _mm512_setzero_ps();
#define CONTBATCH_STORE(r)                                                         \
  _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(c##r##0, d0));                       \
  _mm512_mask_storeu_ps(y + r * ldy + kPanel, high, _mm512_add_ps(c##r##1, d1));
  CONTBATCH_TILE_ROWS(CONTBATCH_STORE)
#undef CONTBATCH_START
#undef CONTBATCH_FMA
#undef CONTBATCH_STORE
}

constexpr TileFn<float, float> kWideTiles[kTileRows + 1] = {nullptr, wide_tile<1>, wide_tile<2>, wide_tile<3>,
                                                             wide_tile<4>, wide_tile<5>, wide_tile<6>};
#endif

#if defined(__AVX512BF16__)
constexpr int64_t kPairRows = 8;
constexpr int64_t kPairWidth = 3;

// One R x 16W tile over W adjacent pair panels (`stride` elements apart; ncols of the 16W columns real): per k pair,
// one load of each panel's line and R broadcasts of the rows' pairs feed RW `vdpbf16ps` into RW accumulators (the
// loops are unrolled, so the arrays live in registers).
template <int R, int W>
inline void pair_tile(const int32_t* x, int64_t ldx, int64_t kc, const uint16_t* panel, int64_t stride, float* y,
                      int64_t ldy, int64_t ncols, const float* bias, bool resume, bool finish) {
  __mmask16 mask[W];
  __m512 c[R][W];
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) {
    mask[w] = static_cast<__mmask16>((1u << std::clamp<int64_t>(ncols - w * kPanel, 0, kPanel)) - 1u);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      c[r][w] = resume ? _mm512_maskz_loadu_ps(mask[w], y + r * ldy + w * kPanel) : _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m512bh b[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) b[w] = (__m512bh)_mm512_loadu_si512(panel + w * stride + k * 2 * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) c[r][w] = _mm512_dpbf16_ps(c[r][w], a, b[w]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const __m512 d = finish && bias ? _mm512_maskz_loadu_ps(mask[w], bias + w * kPanel) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(y + r * ldy + w * kPanel, mask[w], _mm512_add_ps(c[r][w], d));
    }
  }
}

template <int W, int... Rs>
constexpr std::array<TileFn<int32_t, uint16_t>, kPairRows + 1> pair_tiles(std::integer_sequence<int, Rs...>) {
  return {nullptr, pair_tile<Rs + 1, W>...};
}
constexpr std::array<TileFn<int32_t, uint16_t>, kPairRows + 1> kPairTiles[kPairWidth] = {
    pair_tiles<1>(std::make_integer_sequence<int, kPairRows>{}),
    pair_tiles<2>(std::make_integer_sequence<int, kPairRows>{}),
    pair_tiles<3>(std::make_integer_sequence<int, kPairRows>{})};
#endif

}  // namespace
#endif
