// The vector path of contbatch's CPU attention (decode_attention.cpp): a thread's tasks as a pipeline in which one
// task's value pass runs beside the next task's key pass.
//
// A task makes two passes over its rows: the key pass computes every score, then an exact softmax over them; the
// value pass sums the value rows weighted by the probabilities. Run one after the other, each pass reads one stream
// of rows from memory and waits on it. Here the value pass of task i and the key pass of task i + 1 take turns, 16
// rows each: two streams of rows in flight at once, each row prefetched kPrefetchRows positions before it is read,
// in small bursts between the passes' pieces of arithmetic (`burst_rows`). Each task's arithmetic is the same, in the
// same order, as when it runs alone.
//
// The scores (`Scores`): float32 lanes over rows widened as they are read (`scores_of_rows`, attention_rows.h);
// for a bfloat16 cache with AVX512-BF16, bfloat16 pairs (`scores_of_pairs`, attention_pairs.h); with AMX as well,
// tiles of 16 positions wherever their key rows lie one after another (`tile_scores16`, attention_tiles.h), pairs
// elsewhere; with AMX the value pass is tiles too (`value_tiles`, attention_values.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attention_pairs.h"
#include "attention_rows.h"
#include "attention_tiles.h"
#include "attention_values.h"
#include "softmax.h"

#ifdef CONTBATCH_AVX2
enum class Scores { kLanes, kPairs, kTiles };

constexpr int64_t kValueRows = 16;
constexpr int64_t kPrefetchRows = 16;

// One task in the pipeline: its scores (then probabilities), `stride` a head; its output's float32 sums; its query
// heads in float32 for the lane kernels, in bfloat16 (and packed for tiles) for the pair and tile kernels.
template <typename T>
struct Stage {
  Task<T> task{};
  std::vector<float> scores, query32, sums, factors;
  std::vector<c10::BFloat16> query, tiles;
  mutable std::vector<c10::BFloat16> pairs, weights;  // the value pass's scratch (`value_tiles`)
  int64_t stride = 0;
};

// Whether task t's value pass runs in AMX tiles (attention_values.h): with tiles, for heads of at most
// kTileColumns columns. Wider heads keep the pair kernels' value pass for every row (alone or in a run, so that each
// row's output stays the same bits either way): their sums, through memory at each 32 positions, made decode rows
// 8-10% slower (head_dim 128, docs/performance.md, "a sixty-fifth session").
template <Scores K, typename T>
static inline bool weighs_in_tiles(const Task<T>& t) {
#ifdef CONTBATCH_TILES
  if constexpr (K == Scores::kTiles) return t.dim <= kTileColumns;
#endif
  return false;
}

// Readies `s` for task t's key pass.
template <Scores K, typename T>
static void begin_keys(Stage<T>& s, const Task<T>& t) {
  s.task = t;
  s.stride = (t.length - t.first + 7) / 8 * 8;
  s.scores.resize(t.group * s.stride);
  s.sums.resize(t.group * t.dim);
  s.task.out = s.sums.data();
  if constexpr (K == Scores::kLanes) {
    s.query32.resize(t.group * t.dim);
    widen_query(t, s.query32.data());
    s.task.q = s.query32.data();
  }
#ifdef CONTBATCH_PAIRS
  if constexpr (K != Scores::kLanes) {
    s.query.resize(t.group * t.dim);
    for (int64_t g = 0; g < t.group; ++g)
      std::copy(t.query + g * t.query_stride, t.query + g * t.query_stride + t.dim, s.query.data() + g * t.dim);
  }
#endif
#ifdef CONTBATCH_TILES
  if constexpr (K == Scores::kTiles) {
    s.tiles.resize(t.group * t.dim);
    query_tiles(s.query.data(), t.group, t.dim, s.tiles.data());
    s.pairs.resize(kValueChunk * t.dim);
    s.weights.resize(t.group * kValueChunk);
  }
#endif
}

// The scores of the stage's positions [j0, j0 + 8) (those below its length).
template <typename S, Scores K, typename T>
static inline void key_rows(Stage<T>& s, int64_t j0) {
  const Task<T>& t = s.task;
  const int64_t count = std::min<int64_t>(8, t.length - j0);
  const T* rows[8];
  for (int i = 0; i < 8; ++i) rows[i] = t.k + t.slots[j0 + std::min<int64_t>(i, count - 1)] * t.dim;
  float* out = s.scores.data() + (j0 - t.first);
#ifdef CONTBATCH_PAIRS
  if constexpr (K != Scores::kLanes) {
    scores_of_pairs(t, s.query.data(), rows, count, out, s.stride);
    return;
  }
#endif
  if constexpr (S::kWidth == 8)
    scores_of_rows_apart<S>(t, rows, count, out, s.stride);
  else
    scores_of_rows<S>(t, rows, count, out, s.stride);
}

// The scores of the stage's positions [j0, end), end - j0 <= kValueRows.
template <typename S, Scores K, typename T>
static CONTBATCH_INLINE void key_chunk(Stage<T>& s, int64_t j0, int64_t end) {
#ifdef CONTBATCH_TILES
  if constexpr (K == Scores::kTiles) {
    const Task<T>& t = s.task;
    if (end - j0 == kTileRows && rows_follow(t.slots, j0)) {
      tile_scores16(t, t.k + t.slots[j0] * t.dim, s.tiles.data(), s.scores.data() + (j0 - t.first), s.stride);
      return;
    }
  }
#endif
  for (; j0 < end; j0 += 8) key_rows<S, K>(s, j0);
}

// Each group's scores replaced by their softmax (lanes at -inf give 0), with a head's sink logit in its denominator
// where the task has sinks; the outputs zeroed. With tiles, the scores become exp(score - the largest) only, and
// each head's 1 / denominator waits in `factors` for `finish_values`: the value pass rounds them to bfloat16 either
// way, and this saves a pass.
template <Scores K, typename T>
static void finish_keys(Stage<T>& s) {
  const Task<T>& t = s.task;
  const bool tiles = weighs_in_tiles<K>(t);
  s.factors.resize(t.group);
  for (int64_t g = 0; g < t.group; ++g) {
    float* p = s.scores.data() + g * s.stride;
    const float highest = t.sinks ? std::max(max_of(p, s.stride), t.sinks[g]) : max_of(p, s.stride);
#ifdef CONTBATCH_TILES
    const float total = tiles ? exp_in_place16(p, s.stride, highest) : exp_in_place(p, s.stride, highest);
#else
    const float total = exp_in_place(p, s.stride, highest);
#endif
    const float sink = t.sinks ? std::exp(t.sinks[g] - highest) : 0.f;
    s.factors[g] = 1.f / (total + sink);
    if (!tiles) scale_in_place(p, s.stride, s.factors[g]);
    std::fill(t.out + g * t.dim, t.out + (g + 1) * t.dim, 0.f);
  }
}

// out[g] += the value rows [j0, j0 + n) (those below the length, n <= kValueRows) weighted by their probabilities;
// with tiles, the pieces [j0, j0 + n) of a pass, in order, gather into the chunks of `value_tiles`, each added at its
// last piece.
template <typename S, Scores K, typename T>
__attribute__((noinline)) static void value_rows(const Stage<T>& s, int64_t j0, int64_t n) {
  constexpr int kOneHeadVectors = static_cast<int>(64 / S::kWidth);  // 64 columns a pass for a lone head
  const Task<T>& t = s.task;
  const int64_t count = std::min<int64_t>(n, t.length - j0), dim = t.dim;
#ifdef CONTBATCH_TILES
  if (weighs_in_tiles<K>(t)) {
    const int64_t end = j0 + count, at = (end - t.first) % kValueChunk;
    if (at == 0 || end == t.length) {
      const int64_t start = end - (at == 0 ? kValueChunk : at);
      value_tiles(t, s.scores.data() + (start - t.first), s.stride, start, end - start, s.pairs.data(),
                  s.weights.data());
    }
    return;
  }
#endif
  const T* rows[kValueRows];
  for (int64_t i = 0; i < count; ++i) rows[i] = t.v + t.slots[j0 + i] * dim;
  const float* p = s.scores.data() + (j0 - t.first);
#ifdef CONTBATCH_PAIRS
  if constexpr (K != Scores::kLanes) {
    weigh_pairs(t, p, s.stride, rows, count);
    return;
  }
#endif
  for (int64_t g = 0; g < t.group; g += 4) {
    float* out = t.out + g * dim;
    const float* pg = p + g * s.stride;
    switch (std::min<int64_t>(4, t.group - g)) {
      case 1: accumulate_values<S, 1, kOneHeadVectors>(pg, s.stride, rows, count, dim, out); break;
      case 2: accumulate_values<S, 2, 4>(pg, s.stride, rows, count, dim, out); break;
      case 3: accumulate_values<S, 3, 4>(pg, s.stride, rows, count, dim, out); break;
      default: accumulate_values<S, 4, 2>(pg, s.stride, rows, count, dim, out); break;
    }
  }
}

// Prefetches the rows of positions [from, to) (those below `length`) to cache level 1 (Loc 3) or 2 (Loc 2).
template <int Loc, typename T>
static inline void prefetch_rows(const T* base, const int64_t* slots, int64_t from, int64_t to, int64_t length,
                                 int64_t dim) {
  for (int64_t j = from; j < std::min(to, length); ++j) prefetch_row<Loc>(base + slots[j] * dim, dim);
}

// The rows of each stream one burst of prefetches asks for: a power of two from 4 to a turn's (kValueRows), the
// largest whose rows take at most 1 KiB (16 lines) where one exists. A burst larger than the core's line fill
// buffers stalls it at the prefetch until lines arrive, with no arithmetic running meanwhile (docs/performance.md,
// "a sixty-second session").
template <typename T>
static inline int64_t burst_rows(int64_t dim) {
  int64_t rows = kValueRows;
  while (rows > 4 && rows * dim * static_cast<int64_t>(sizeof(T)) > 1024) rows /= 2;
  return rows;
}

// The value pass of `values` and the key pass of `keys` (either may be null), kValueRows rows of each in turn. Each
// turn prefetches the next kValueRows rows of both streams kPrefetchRows positions ahead, in bursts of `burst_rows`
// rows: one before the keys' rows, one before each later `burst_rows` of the values' rows. A stage whose rows are in
// cache already (`Task::warm`) prefetches nothing.
template <typename S, Scores K, int Loc, typename T>
static void overlap(const Stage<T>* values, Stage<T>* keys) {
  int64_t jv = values ? values->task.first : 0, jk = keys ? keys->task.first : 0;
  const int64_t nv = values ? values->task.length : 0, nk = keys ? keys->task.length : 0;
  const bool fetch_keys = keys && !keys->task.warm, fetch_values = values && !values->task.warm;
  const int64_t dim = keys ? keys->task.dim : values ? values->task.dim : 0, burst = burst_rows<T>(dim);
  while (jv < nv || jk < nk) {
    int64_t ahead = kPrefetchRows;
    const auto fetch = [&] {
      if (fetch_keys) prefetch_rows<Loc>(keys->task.k, keys->task.slots, jk + ahead, jk + ahead + burst, nk, dim);
      if (fetch_values)
        prefetch_rows<Loc>(values->task.v, values->task.slots, jv + ahead, jv + ahead + burst, nv, dim);
      ahead += burst;
    };
    fetch();
    const int64_t end = std::min(jk + kValueRows, nk);
    if (jk < nk) key_chunk<S, K>(*keys, jk, end);
    for (int64_t r = 0; r < kValueRows; r += burst) {
      if (r > 0) fetch();
      if (jv + r < nv) value_rows<S, K>(*values, jv + r, burst);
    }
    jk = std::max(jk, end);
    jv += kValueRows;
  }
}

// The outputs of a stage whose value pass is done, in column order, stored in the cache's dtype (bfloat16 rounded as
// c10::BFloat16 rounds).
template <Scores K, typename T>
static inline void finish_values(const Stage<T>& s) {
  const Task<T>& t = s.task;
#ifdef CONTBATCH_TILES
  if (weighs_in_tiles<K>(t)) untile_rows(t.out, t.group, t.dim, s.factors.data());
#endif
#ifdef CONTBATCH_PAIRS
  if (K != Scores::kLanes && !weighs_in_tiles<K>(t)) unpair_rows(t.out, t.group, t.dim);
#endif
  const int64_t count = t.group * t.dim;
  if constexpr (std::is_same_v<T, float>) {
    std::copy(t.out, t.out + count, t.dest);
  } else {
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) store8(t.dest + i, _mm256_loadu_ps(t.out + i));
    for (; i < count; ++i) t.dest[i] = static_cast<T>(t.out[i]);
  }
}

#endif
