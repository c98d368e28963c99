// AMX tiles for the value pass of contbatch's CPU attention (decode_attention.cpp), for a bfloat16 cache where the
// CPU has AMX (attention_tiles.h) and the head has at most kTileColumns columns (`weighs_in_tiles`,
// attention_pipeline.h): each 32 positions of a row, counted from its first, add to its float32 sums one
// tile product per 16 columns, its probabilities rounded to bfloat16 [heads, 32] times the positions' value rows in
// pairs [16 pairs, 16 columns, 2] (`_tile_dpbf16ps`: float32 sums of exact products). Positions past a row's length
// weigh zero. A lone row's heads are the tile's rows (`value_tiles`); a run's rows of one head are
// (`run_value_tiles`, attention_runs.h). An output row depends only on its own probabilities and the value rows, so
// a row's output is the same bit for bit alone, in a run, in a decode step or in a prompt's chunk.
//
// Against float32 probabilities times widened value rows (the pair kernels' value pass), a prompt's rows in runs
// take about a third less time: a tile product serves 16 rows. The probabilities' rounding is the one bfloat16
// rounding more (docs/performance.md, "a sixty-fifth session"). The sums are kept in tile order (`value_pairs`)
// until `untile_rows` puts the columns back.
#pragma once

#include <algorithm>
#include <vector>

#include "attention_tiles.h"

#ifdef CONTBATCH_TILES
constexpr int64_t kValueChunk = 32;

// The value rows of positions [j0, j0 + n) (n <= 32; zero rows past n) as the tile operands of each 16 columns, at
// out[(u * 16 + k) * 32, + 32) for tile u and pair k of positions (j0 + 2k, j0 + 2k + 1). `_mm512_unpacklo_epi16`
// and `_mm512_unpackhi_epi16` pair the columns of each 32 into two tiles, in the order `untile_rows` undoes.
template <typename T>
static inline void value_pairs(const T* v, const int64_t* slots, int64_t j0, int64_t n, int64_t dim,
                               c10::BFloat16* out) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t k = 0; k < kValueChunk / 2; ++k) {
    const T* even = 2 * k < n ? v + slots[j0 + 2 * k] * dim : nullptr;
    const T* odd = 2 * k + 1 < n ? v + slots[j0 + 2 * k + 1] * dim : nullptr;
    for (int64_t c = 0; c < dim; c += 32) {
      const __m512i a = even ? _mm512_loadu_si512(even + c) : zero, b = odd ? _mm512_loadu_si512(odd + c) : zero;
      _mm512_storeu_si512(out + ((c / 16) * 16 + k) * 32, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(out + ((c / 16 + 1) * 16 + k) * 32, _mm512_unpackhi_epi16(a, b));
    }
  }
}

// The probabilities probs[0, n) rounded to bfloat16 as a tile row of 32 (zero past n, n <= 32), at out.
static inline void probs_row(const float* probs, int64_t n, c10::BFloat16* out) {
  const auto low = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
  const auto high = static_cast<__mmask16>(n >= 32 ? 0xFFFF : n <= 16 ? 0 : (1u << (n - 16)) - 1);
  const __m512bh pairs =
      _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, probs + 16), _mm512_maskz_loadu_ps(low, probs));
  _mm512_storeu_si512(out, reinterpret_cast<__m512i>(pairs));
}

constexpr int64_t kTileColumns = 64;  // the widest head whose lone row's sums fit in tiles 3-6

// Tile 3 + u: `_tile_dpbf16ps` of the probabilities (tile 7) and 16 columns' pairs (tile 1) into it, its zeroing
// or its store to out (row stride `stride` bytes). Tile numbers are immediates, hence the switch.
enum class SumOp { kZero, kAdd, kStore };
template <SumOp Op>
static CONTBATCH_INLINE void sum_tile(int64_t u, float* out = nullptr, int64_t stride = 0) {
#define CONTBATCH_SUM_TILE(n)                          \
  if constexpr (Op == SumOp::kZero) _tile_zero(n);     \
  if constexpr (Op == SumOp::kAdd) _tile_dpbf16ps(n, 7, 1); \
  if constexpr (Op == SumOp::kStore) _tile_stored(n, out, stride);
  switch (u) {
    case 0: CONTBATCH_SUM_TILE(3) break;
    case 1: CONTBATCH_SUM_TILE(4) break;
    case 2: CONTBATCH_SUM_TILE(5) break;
    default: CONTBATCH_SUM_TILE(6) break;
  }
#undef CONTBATCH_SUM_TILE
}

// The task's sums (float32 [group, dim], tile order) += its value rows of positions [j0, j0 + n) (n <= 32) weighted
// by its probabilities (tiles `kLone`, `weighs_in_tiles`): tile 7 the heads' probabilities, tile 1 each 16 columns'
// pairs, the sums in tiles 3-6 from the pass's first chunk (zeroed there) to its last (stored there).
template <typename T>
static void value_tiles(const Task<T>& t, const float* probs, int64_t stride, int64_t j0, int64_t n,
                        c10::BFloat16* pairs, c10::BFloat16* weights) {
  value_pairs(t.v, t.slots, j0, n, t.dim, pairs);
  for (int64_t g = 0; g < t.group; ++g) probs_row(probs + g * stride, n, weights + g * kValueChunk);
  _tile_loadd(7, weights, 64);
  for (int64_t u = 0; u < t.dim / 16; ++u) {
    if (j0 == t.first) sum_tile<SumOp::kZero>(u);
    _tile_loadd(1, pairs + u * 16 * 32, 64);
    sum_tile<SumOp::kAdd>(u);
    if (j0 + n == t.length) sum_tile<SumOp::kStore>(u, t.out + u * 16, t.dim * 4);
  }
}

// The `rows` output rows at out ([rows, dim], tile order, `value_pairs`) put back in column order, row g times
// factors[g] (its softmax's 1 / denominator, `finish_keys`).
static inline void untile_rows(float* out, int64_t rows, int64_t dim, const float* factors) {
  const __m512i low = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i high = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  for (int64_t g = 0; g < rows; ++g) {
    const __m512 factor = _mm512_set1_ps(factors[g]);
    for (float* c = out + g * dim; c < out + (g + 1) * dim; c += 32) {
      const __m512 first = _mm512_loadu_ps(c), second = _mm512_loadu_ps(c + 16);
      _mm512_storeu_ps(c, _mm512_mul_ps(_mm512_permutex2var_ps(first, low, second), factor));
      _mm512_storeu_ps(c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(first, high, second), factor));
    }
  }
}
#endif
