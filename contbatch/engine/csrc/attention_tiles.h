// AMX tiles for the scores of contbatch's CPU attention (decode_attention.cpp), for a bfloat16 cache where the CPU
// has AMX: 16 positions whose key rows lie one after another in the cache (one block) take one tile of key rows per
// 32 columns, times the query heads packed as a tile of bfloat16 pairs (`_tile_dpbf16ps`: float32 sums of exact
// products). Positions split across blocks, and the last positions of a row, take the pair kernels
// (attention_pairs.h).
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

// The tile configuration for `group` query heads (at most 16): tile 0 the scores [16 positions, group], tile 1 16 key
// rows' 32 columns, tile 2 the query heads' 32 columns as 16 pairs [16, group, 2].
struct ScoreTiles {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};

  explicit ScoreTiles(int64_t group) {
    const auto across = static_cast<uint16_t>(group * 4);
    rows[0] = rows[1] = rows[2] = kTileRows;
    bytes[0] = bytes[2] = across;
    bytes[1] = 64;
  }
};

// This thread's tiles configured for `group` heads for the life of the object; released after, with torch's record
// of the thread's configuration cleared, so that its next AMX product configures its own.
class TileScope {
 public:
  explicit TileScope(int64_t group) {
    alignas(64) ScoreTiles config(group);
    asm volatile("" : : "r"(&config) : "memory");  // the compiler does not see ldtilecfg read the configuration
    _tile_loadconfig(&config);
  }
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
  const __m512 scale = _mm512_set1_ps(t.scale);
  for (int64_t g = 0; g < t.group; ++g) {
    __m512 s = _mm512_mul_ps(_mm512_i32gather_ps(_mm512_add_epi32(across, _mm512_set1_epi32(g)), sums, 4), scale);
    if (t.softcap > 0.f) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, s);
      for (float& x : lanes) x = t.softcap * std::tanh(x / t.softcap);
      s = _mm512_load_ps(lanes);
    }
    _mm512_storeu_ps(out + g * stride, s);
  }
}
#endif
