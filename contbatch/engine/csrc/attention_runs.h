// Runs of rows for contbatch's CPU attention (decode_attention.cpp): up to kRunRows consecutive query rows of one
// request with the same first position (a prefill chunk's causal rows), taken together for one kv head.
//
// Alone, each such row reads all of its request's key and value rows, so a chunk of R rows streams them R times from
// L2 or memory. A run takes each 16 positions for every row in turn: the key pass of every row over those positions,
// then each row's softmax, then the value pass likewise, so each key and value row leaves L2 (or memory) once for the
// run and the other rows read it from L1. Each row's arithmetic is that of its task alone: the same blocks of
// positions, in the same order, through the same kernels, so the outputs are the same bit for bit.
#pragma once

#include <algorithm>
#include <vector>

#include "attention_pipeline.h"

constexpr int64_t kRunRows = 16;

// The bounds of the runs of rows [0, batch): row b starts a new run unless it is of the request of row b - 1, with
// its first position, and that run has fewer than kRunRows rows.
static inline std::vector<int64_t> row_runs(const int64_t* request, const int64_t* start, int64_t batch) {
  std::vector<int64_t> bounds{0};
  for (int64_t b = 1; b < batch; ++b)
    if (request[b] != request[b - 1] || start[b] != start[b - 1] || b - bounds.back() >= kRunRows)
      bounds.push_back(b);
  bounds.push_back(batch);
  return bounds;
}

#ifdef CONTBATCH_AVX2
#ifdef CONTBATCH_TILES
// The query heads of the run's stages[0, count) as `run_scores16`'s operand: out[(g * 16 + r) * dim + d] for head g of
// row r (zero for the rows past `count`).
template <typename T>
static void run_queries(const std::vector<Stage<T>>& stages, int64_t count, std::vector<c10::BFloat16>& out) {
  const int64_t group = stages[0].task.group, dim = stages[0].task.dim;
  out.assign(group * kTileRows * dim, c10::BFloat16(0.f));
  for (int64_t r = 0; r < count; ++r)
    for (int64_t g = 0; g < group; ++g)
      std::copy_n(stages[r].query.data() + g * dim, dim, out.data() + (g * kTileRows + r) * dim);
}
#endif

// The scores of positions [j0, j0 + kValueRows) of each of the run's tasks[0, count) (those below its length). With
// tiles, where the 16 positions' key rows lie one after another, one tile product a query head serves every task
// holding all 16 (`run_scores16` over the run's `queries`).
template <typename S, Scores K, typename T>
static CONTBATCH_INLINE void run_keys(std::vector<Stage<T>>& stages, const std::vector<Task<T>>& tasks, int64_t count,
                                      int64_t j0, int64_t longest, const c10::BFloat16* queries) {
#ifdef CONTBATCH_TILES
  if constexpr (K == Scores::kTiles) {
    const Task<T>& lead = tasks[0];
    if (j0 + kTileRows <= longest && rows_follow(lead.slots, j0)) {
      static thread_local std::vector<c10::BFloat16> pairs;
      static thread_local std::vector<float> sums;
      pairs.resize(kTileRows * lead.dim);
      sums.resize(lead.group * kTileRows * 16);
      key_pairs16(lead.k + lead.slots[j0] * lead.dim, lead.dim, pairs.data());
      run_scores16(pairs.data(), queries, lead.group, lead.dim, sums.data());
      for (int64_t r = 0; r < count; ++r) {
        Stage<T>& s = stages[r];
        if (j0 + kTileRows <= tasks[r].length) {
          float* out = s.scores.data() + (j0 - s.task.first);
          const float* row = sums.data() + r * 16;
          for (int64_t g = 0; g < lead.group; ++g)
            _mm512_storeu_ps(out + g * s.stride, finish16(_mm512_loadu_ps(row + g * kTileRows * 16), lead));
        } else if (j0 < tasks[r].length) {
          key_chunk<S, K>(s, j0, tasks[r].length);
        }
      }
      return;
    }
  }
#endif
  for (int64_t r = 0; r < count; ++r)
    if (j0 < tasks[r].length) key_chunk<S, K>(stages[r], j0, std::min(j0 + kValueRows, tasks[r].length));
}

#ifdef CONTBATCH_TILES
// The value pass of the run's stages[0, count) (one kv head, `longest` the longest length) in tiles: for each 32
// positions, their value rows in pairs once, then one tile product a query head and 16 columns for all the rows
// (tiles 3-5), each row's probabilities zero past its length. Each row's sums are those `value_tiles` gives it
// alone; they are left in each stage's sums (tile order).
template <typename T, typename Fetch>
static void run_value_tiles(std::vector<Stage<T>>& stages, int64_t count, int64_t longest, Fetch fetch) {
  static thread_local std::vector<c10::BFloat16> pairs, weights;
  static thread_local std::vector<float> sums;
  const Task<T>& lead = stages[0].task;
  const int64_t dim = lead.dim, group = lead.group;
  pairs.resize(kValueChunk * dim);
  weights.assign(kTileRows * kValueChunk, c10::BFloat16(0.f));
  sums.assign(group * kTileRows * dim, 0.f);
  for (int64_t j0 = lead.first; j0 < longest; j0 += kValueChunk) {
    fetch(j0);
    value_pairs(lead.v, lead.slots, j0, std::min(kValueChunk, longest - j0), dim, pairs.data());
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t r = 0; r < count; ++r) {
        const Stage<T>& s = stages[r];
        const int64_t n = std::clamp<int64_t>(s.task.length - j0, 0, kValueChunk);
        probs_row(s.scores.data() + g * s.stride + (j0 - s.task.first), n, weights.data() + r * kValueChunk);
      }
      _tile_loadd(4, weights.data(), 64);
      float* head = sums.data() + g * kTileRows * dim;
      for (int64_t u = 0; u < dim / 16; ++u) {
        _tile_loadd(3, head + u * 16, dim * 4);
        _tile_loadd(5, pairs.data() + u * 16 * 32, 64);
        _tile_dpbf16ps(3, 4, 5);
        _tile_stored(3, head + u * 16, dim * 4);
      }
    }
  }
  for (int64_t r = 0; r < count; ++r)
    for (int64_t g = 0; g < group; ++g)
      std::copy_n(sums.data() + (g * kTileRows + r) * dim, dim, stages[r].task.out + g * dim);
}
#endif

// The tasks tasks[0, count) of one run (one kv head, the same slots and first position) attended together; only the
// first task's `warm` decides whether the run prefetches its rows. `stages` holds at least `count` stages.
template <typename S, Scores K, int Loc, typename T>
static void attend_run(std::vector<Stage<T>>& stages, const std::vector<Task<T>>& tasks, int64_t count) {
  int64_t longest = 0;
  for (int64_t r = 0; r < count; ++r) {
    begin_keys<K>(stages[r], tasks[r]);
    longest = std::max(longest, tasks[r].length);
  }
  const Task<T>& lead = tasks[0];
  const bool fetch = !lead.warm;
  static thread_local std::vector<c10::BFloat16> queries;
#ifdef CONTBATCH_TILES
  if constexpr (K == Scores::kTiles) run_queries(stages, count, queries);
#endif
  for (int64_t j0 = lead.first; j0 < longest; j0 += kValueRows) {
    if (fetch) prefetch_rows<Loc>(lead.k, lead.slots, j0 + kPrefetchRows, j0 + kPrefetchRows + kValueRows, longest,
                                  lead.dim);
    run_keys<S, K>(stages, tasks, count, j0, longest, queries.data());
  }
  for (int64_t r = 0; r < count; ++r) finish_keys<K>(stages[r]);
#ifdef CONTBATCH_TILES
  if (weighs_in_tiles<K>(lead)) {
    run_value_tiles(stages, count, longest, [&](int64_t j0) {
      if (fetch) prefetch_rows<Loc>(lead.v, lead.slots, j0 + kPrefetchRows, j0 + kPrefetchRows + kValueChunk, longest,
                                    lead.dim);
    });
    for (int64_t r = 0; r < count; ++r) finish_values<K>(stages[r]);
    return;
  }
#endif
  for (int64_t j0 = lead.first; j0 < longest; j0 += kValueRows) {
    if (fetch) prefetch_rows<Loc>(lead.v, lead.slots, j0 + kPrefetchRows, j0 + kPrefetchRows + kValueRows, longest,
                                  lead.dim);
    for (int64_t r = 0; r < count; ++r)
      if (j0 < tasks[r].length) value_rows<S, K>(stages[r], j0, kValueRows);
  }
  for (int64_t r = 0; r < count; ++r) finish_values<K>(stages[r]);
}

// A thread's work: `next(tasks)` fills `tasks` with the next run's tasks (one kv head) and returns how many, 0 when
// there are no more. A run of one row goes through the pipeline (its value pass beside the next one's key pass);
// a longer run, after the pipeline's pending task is done, through `attend_run`.
template <typename S, Scores K, int Loc, typename T, typename Next>
static void attend_all(Next next) {
  Stage<T> stages[2];
  Stage<T>* pending = nullptr;
  std::vector<Stage<T>> run_stages(kRunRows);
  std::vector<Task<T>> tasks(kRunRows);
  const auto drain = [&] {
    if (pending == nullptr) return;
    overlap<S, K, Loc, T>(pending, nullptr);
    finish_values<K>(*pending);
    pending = nullptr;
  };
  for (int at = 0;;) {
    const int64_t count = next(tasks);
    if (count == 0) break;
    if (count > 1) {
      drain();
#ifdef CONTBATCH_TILES
      if constexpr (K == Scores::kTiles) configure_tiles(tasks[0].group, TileUse::kRun);
#endif
      attend_run<S, K, Loc>(run_stages, tasks, count);
#ifdef CONTBATCH_TILES
      if constexpr (K == Scores::kTiles) configure_tiles(tasks[0].group, TileUse::kLone);
#endif
      continue;
    }
    Stage<T>& s = stages[at];
    at ^= 1;
    begin_keys<K>(s, tasks[0]);
    overlap<S, K, Loc>(pending, &s);
    if (pending) finish_values<K>(*pending);
    finish_keys<K>(s);
    pending = &s;
  }
  drain();
}
#endif
