// AMX tiles for the scores of contbatch's CPU attention (decode_attention.cpp), for a bfloat16 cache where the CPU
// has AMX: 16 positions whose key rows lie one after another in the cache (one block) take one tile of key rows per
// 32 columns, times the query heads packed as a tile of bfloat16 pairs (`_tile_dpbf16ps`: float32 sums of exact
// products). The rows of a run (attention_runs.h) share the 16 key rows transposed into pairs, times each query head's
// rows of the run as the tile's rows (`run_scores16`: the same sums, one tile product a head for up to 16 rows).
// Positions split across blocks, and the last positions of a row, take the pair kernels (attention_pairs.h).
#pragma once

#include <ATen/native/CPUBlas.h>

#include <cstdint>

#include "attention_pairs.h"

#if defined(CONTBATCH_PAIRS) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CONTBATCH_TILES 1
#include <sys/syscall.h>
#include <unistd.h>

constexpr int64_t kTileRows = 16;

// Whether this process may use AMX tiles (Linux grants the tile state on request, asked once).
inline bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// What the tiles hold: for lone rows (`kLone`), tile 0 the scores [16 positions, group], tile 1 16 key rows' 32
// columns (or, in the value pass, 16 pairs of value rows' 16 columns [16, 16, 2], attention_values.h), tile 2 the
// query heads' 32 columns as 16 pairs [16, group, 2], tiles 3-6 a task's float32 sums of each 16 columns [group, 16]
// and tile 7 its probabilities of 32 positions [group, 32]. For a run's rows (`kRun`), tiles 0-2 as for lone rows
// (unused: a run's rows take pairs wherever they do not take `run_scores16`), and tiles 3-5 [16, 64 bytes]: in the
// key pass (`run_scores16`) the scores of one query head [16 rows, 16 positions], that head's 32 columns of the 16
// rows, 16 key rows' 32 columns as 16 pairs; in the value pass, the sums [16 rows, 16 columns], the probabilities
// [16 rows, 32 positions], the value rows' pairs.
enum class TileUse { kLone, kRun };

// The tile configuration of `use` for `group` query heads (at most 16).
struct ScoreTiles {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};

  ScoreTiles(int64_t group, TileUse use) {
    const auto across = static_cast<uint16_t>(group * 4);
    for (int i = 0; i < 8; ++i) {
      rows[i] = use == TileUse::kRun || i < 3 ? kTileRows : static_cast<uint8_t>(group);
      bytes[i] = 64;
    }
    bytes[0] = bytes[2] = across;
  }
};

// Configures this thread's tiles for `use` with `group` query heads (their contents become zero).
static inline void configure_tiles(int64_t group, TileUse use) {
  alignas(64) ScoreTiles config(group, use);
  asm volatile("" : : "r"(&config) : "memory");  // the compiler does not see ldtilecfg read the configuration
  _tile_loadconfig(&config);
}

// This thread's tiles configured for lone rows of `group` heads for the life of the object; released after, with
// torch's record of the thread's configuration cleared, so that its next AMX product configures its own.
class TileScope {
 public:
  explicit TileScope(int64_t group) { configure_tiles(group, TileUse::kLone); }
  ~TileScope() {
    _tile_release();
    at::native::cpublas::brgemm_release();
  }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// Lane i holds i * step (the offsets of 16 rows `step` elements apart, for a gather or a scatter).
static inline __m512i lane_multiples(int64_t step) {
  return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                            _mm512_set1_epi32(static_cast<int32_t>(step)));
}

// The `group` query heads at q (bfloat16 [group, dim]) as tile 2's operand for each 32 columns s:
// out[((s * 16 + r) * group + g) * 2 + e] = q[g][32 s + 2 r + e].
static inline void query_tiles(const c10::BFloat16* q, int64_t group, int64_t dim, c10::BFloat16* out) {
  const __m512i across = lane_multiples(group);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t c = 0; c < dim; c += 32)
      _mm512_i32scatter_epi32(out + (c * group + g * 2), across, _mm512_loadu_si512(q + g * dim + c), 4);
}

// Whether positions [j0, j0 + 16) lie one after another in the cache.
static inline bool rows_follow(const int64_t* slots, int64_t j0) {
  const __m512i base = _mm512_set1_epi64(slots[j0]);
  const __m512i low = _mm512_sub_epi64(_mm512_loadu_si512(slots + j0), base);
  const __m512i high = _mm512_sub_epi64(_mm512_loadu_si512(slots + j0 + 8), base);
  const __m512i steps = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_cmpeq_epi64_mask(low, steps) == 0xFF &&
         _mm512_cmpeq_epi64_mask(high, _mm512_add_epi64(steps, _mm512_set1_epi64(8))) == 0xFF;
}

// 16 sums scaled (and soft capped), as the scores of 16 positions.
template <typename T>
static CONTBATCH_INLINE __m512 finish16(__m512 sums, const Task<T>& t) {
  __m512 s = _mm512_mul_ps(sums, _mm512_set1_ps(t.scale));
  if (t.softcap > 0.f) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, s);
    for (float& x : lanes) x = t.softcap * std::tanh(x / t.softcap);
    s = _mm512_load_ps(lanes);
  }
  return s;
}

// The scores of 16 positions whose key rows start at `keys` (rows `dim` apart) for each query head, scaled (and soft
// capped), at out + g * stride.
template <typename T>
static CONTBATCH_INLINE void tile_scores16(const Task<T>& t, const c10::BFloat16* keys, const c10::BFloat16* query,
                                           float* out, int64_t stride) {
  alignas(64) float sums[kTileRows * 16];
  _tile_zero(0);
  for (int64_t c = 0; c < t.dim; c += 32) {
    _tile_loadd(1, keys + c, t.dim * 2);
    _tile_loadd(2, query + c * t.group, t.group * 4);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, sums, t.group * 4);
  const __m512i across = lane_multiples(t.group);
  for (int64_t g = 0; g < t.group; ++g)
    _mm512_storeu_ps(out + g * stride,
                     finish16(_mm512_i32gather_ps(_mm512_add_epi32(across, _mm512_set1_epi32(g)), sums, 4), t));
}

// r[i] becomes column i of the 16 x 16 matrix of 32-bit elements whose rows were r[0, 16).
static inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88), x1 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xDD);
    t[m] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[4 + m] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[8 + m] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[12 + m] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// The key rows of 16 positions starting at `keys` (rows `dim` apart) as tile 5's operand for each 32 columns c, in
// pairs: out[c * 16 + (p * 16 + j) * 2 + e] = keys[j * dim + c + 2 p + e].
static inline void key_pairs16(const c10::BFloat16* keys, int64_t dim, c10::BFloat16* out) {
  for (int64_t c = 0; c < dim; c += 32) {
    __m512i r[16];
    for (int64_t j = 0; j < kTileRows; ++j) r[j] = _mm512_loadu_si512(keys + j * dim + c);
    transpose16(r);
    for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(out + c * 16 + p * 32, r[p]);
  }
}

// The sums of the scores of 16 positions for each query head of up to 16 rows of a run, from the positions' key rows
// in pairs (`key_pairs16`) and the rows' query heads (bfloat16 [group, 16 rows, dim]), with the rows as the tile's
// rows: sums[(g * 16 + r) * 16 + j] for head g of row r at position j, unscaled. The sums are `tile_scores16`'s:
// `tdpbf16ps` adds the same exact products in the same order of k whichever operand holds the query, and an output
// row depends only on its own query row.
static CONTBATCH_INLINE void run_scores16(const c10::BFloat16* pairs, const c10::BFloat16* queries, int64_t group,
                                          int64_t dim, float* sums) {
  for (int64_t g = 0; g < group; ++g) {
    _tile_zero(3);
    for (int64_t c = 0; c < dim; c += 32) {
      _tile_loadd(4, queries + g * kTileRows * dim + c, dim * 2);
      _tile_loadd(5, pairs + c * 16, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(3, sums + g * kTileRows * 16, 64);
  }
}
#endif
