// The unit of work of contbatch's CPU paged attention (decode_attention.cpp): one query row's heads of one kv head
// against that row's range of its request's keys, and the prefetches its passes share.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

// Blocks of the cache are scattered: the hardware prefetcher stops at each block's end, so every row is fetched
// kPrefetchAhead positions before it is read (prefetching changes no arithmetic).
constexpr int64_t kPrefetchAhead = 8;

// For the kernels of a few rows' arithmetic that every pass calls: inlined wherever called, whatever the number of
// callers (a kernel left out of line measured 8% slower on bfloat16 decode rows, docs/performance.md, "a sixty-second
// session").
#define CONTBATCH_INLINE inline __attribute__((always_inline))

// Loc: __builtin_prefetch's locality, 3 for L1, 2 for L2; 0: no prefetch, for rows in cache already (a prefill
// chunk's rows after its first: prefetch instructions cost issue slots, and prefetching rows in cache made the
// kernel a quarter slower there, docs/performance.md, "a fifty-seventh session").
template <int Loc, typename T>
static inline void prefetch_row(const T* row, int64_t dim) {
  if constexpr (Loc == 0) return;
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));
  for (int64_t d = 0; d < dim; d += kLine) __builtin_prefetch(row + d, 0, Loc);
}

template <typename T>
struct Task {
  const T* query;        // the query heads of one kv head, head g at query + g * query_stride
  int64_t query_stride;
  const T* k;            // this kv head's key slots
  const T* v;            // this kv head's value slots
  const int64_t* slots;  // the request's slot of each position
  int64_t first, length, group, dim;
  float scale, softcap;
  T* dest;               // [group, dim] the output, in the cache's dtype
  const float* sinks;    // [group] the query heads' sink logits (gpt-oss), or null
  bool warm;             // its rows are in cache already: prefetch nothing
  const float* q;        // [group, dim] the query heads in float32, and
  float* out;            // [group, dim] the output's float32 sums: the pass running the task sets both
};

// The query heads of t as float32 in q ([group, dim]).
template <typename T>
static inline void widen_query(const Task<T>& t, float* q) {
  for (int64_t g = 0; g < t.group; ++g)
    for (int64_t d = 0; d < t.dim; ++d) q[g * t.dim + d] = static_cast<float>(t.query[g * t.query_stride + d]);
}

