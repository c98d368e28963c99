// contbatch's paged attention on CPU, for query rows that each attend to their own range of one request's keys: a
// decode step's one query per request, or the causal rows of a prefill chunk (row i of a chunk starting at position
// s reads positions up to s + i, in the cache already, as the layer writes its new keys first). The cache holds
// float32 or bfloat16 (each bfloat16 row widened to float32 as it is read, exactly); the arithmetic is float32
// either way, and a bfloat16 query's output is rounded to bfloat16 once, at the end.
//
// The kernel reads each request's keys and values straight from the paged cache (no gathered copy), one task per
// (query row, kv head), the query heads of a GQA group sharing every key and value row they read; the tasks are cut
// into contiguous ranges of about equal work, one a thread, or several a thread, taken in turn by whichever thread
// is free, in a step mixing decode rows with a prefill chunk's (`balanced_chunks`).
//
// With AVX2 + FMA (8 lanes) or AVX-512 (16 lanes, where head_dim is a multiple of 16), a task makes two passes. The
// first computes every score, 8 positions at a time: with AVX-512, each key row is loaded once for up to 3 query
// heads; then an exact softmax over them (exp as a vector polynomial). The second sums the value rows weighted by the
// probabilities, 16 rows at a time with the output rows held in registers: each output element is one sum over the
// positions in order, whatever the width. Each key row is prefetched 32 positions before it is read, each value row
// during the key pass, and the key rows of a thread's next task while the current one's value pass runs. Elsewhere
// a scalar two-pass loop computes the same function. The prefetches go to L1 or to L2 (`set_attention_prefetch`):
// which streams faster depends on the CPU, and contbatch measures it once a machine (engine/kernel_tuning.py). A task
// right after its thread's task of the same request's previous row (a prefill chunk) prefetches nothing: its rows
// are in cache (`kWarmBytes`).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "attention_task.h"
#include "simd.h"
#include "softmax.h"

static std::atomic<int64_t> prefetch_level{1};

// Where the kernel prefetches rows to: cache level 1 (`prefetcht0`) or 2 (`prefetcht1`); no arithmetic changes.
void set_attention_prefetch(int64_t level) {
  TORCH_CHECK(level == 1 || level == 2, "attention prefetch: cache level 1 or 2, got ", level);
  prefetch_level.store(level, std::memory_order_relaxed);
}

int64_t attention_prefetch() { return prefetch_level.load(std::memory_order_relaxed); }

template <int Loc, typename T>
static void attend_scalar(const Task<T>& t, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t group = t.group, dim = t.dim, n = t.length, f = t.first;
  scores.assign(group * n, 0.f);
  acc.assign(group * dim, 0.f);
  std::vector<float> row_max(group, -INFINITY), row_sum(group, 0.f);
  for (int64_t j = f; j < n; ++j) {
    const T* kr = t.k + t.slots[j] * dim;
    if (j + kPrefetchAhead < n) prefetch_row<Loc>(t.k + t.slots[j + kPrefetchAhead] * dim, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = t.q + g * dim;
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * static_cast<float>(kr[d]);
      s *= t.scale;
      if (t.softcap > 0.f) s = t.softcap * std::tanh(s / t.softcap);
      scores[g * n + j] = s;
      row_max[g] = std::max(row_max[g], s);
    }
  }
  for (int64_t g = 0; g < group && t.sinks; ++g) {
    row_max[g] = std::max(row_max[g], t.sinks[g]);
    row_sum[g] = std::exp(t.sinks[g] - row_max[g]);
  }
  for (int64_t j = f; j < n; ++j) {
    const T* vr = t.v + t.slots[j] * dim;
    if (j + kPrefetchAhead < n) prefetch_row<Loc>(t.v + t.slots[j + kPrefetchAhead] * dim, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = std::exp(scores[g * n + j] - row_max[g]);
      row_sum[g] += p;
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * static_cast<float>(vr[d]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) t.out[g * dim + d] = acc[g * dim + d] / row_sum[g];
}

#ifdef CONTBATCH_AVX2
// The scores' scale (and soft cap) applied to 8 sums, lanes >= count set to -inf.
template <typename T>
static inline __m256 finish8(__m256 s, const Task<T>& t, int64_t count) {
  s = _mm256_mul_ps(s, _mm256_set1_ps(t.scale));
  if (t.softcap > 0.f) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, s);
    for (float& x : lanes) x = t.softcap * std::tanh(x / t.softcap);
    s = _mm256_load_ps(lanes);
  }
  const __m256 valid = _mm256_cmp_ps(_mm256_set_ps(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_ps(float(count)), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, valid);
}

// The 8 scores of each of the GN query heads q + g * dim against the key rows kr[0, 8), finished (`finish8`),
// stored at out + g * stride. Each key row is loaded once for the GN heads.
template <typename S, int GN, typename T>
static inline void scores8(const float* q, const T* const* kr, const Task<T>& t, int64_t count, float* out,
                           int64_t stride) {
  typename S::V a[GN][8];
  for (int g = 0; g < GN; ++g)
    for (int i = 0; i < 8; ++i) a[g][i] = S::zero();
  for (int64_t c = 0; c < t.dim; c += S::kWidth) {
    typename S::V qv[GN];
    for (int g = 0; g < GN; ++g) qv[g] = S::load(q + g * t.dim + c);
    for (int i = 0; i < 8; ++i) {
      const typename S::V k = S::load(kr[i] + c);
      for (int g = 0; g < GN; ++g) a[g][i] = S::fma(qv[g], k, a[g][i]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GN; ++g) {
    __m256 folded[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) folded[i] = S::fold(a[g][i]);
    _mm256_storeu_ps(out + g * stride, finish8(reduce8(folded), t, count));
  }
}

// `scores8` for every query head of the task, up to 3 heads per pass over the rows with 16 lanes (1 with 8: AVX2
// has 16 registers).
template <typename S, typename T>
static inline void scores_of_rows(const Task<T>& t, const T* const* kr, int64_t count, float* out, int64_t stride) {
  for (int64_t g = 0; g < t.group;) {
    const int64_t left = t.group - g;
    if constexpr (S::kWidth == 16) {
      if (left >= 3) {
        scores8<S, 3>(t.q + g * t.dim, kr, t, count, out + g * stride, stride);
        g += 3;
        continue;
      }
      if (left == 2) {
        scores8<S, 2>(t.q + g * t.dim, kr, t, count, out + g * stride, stride);
        g += 2;
        continue;
      }
    }
    scores8<S, 1>(t.q + g * t.dim, kr, t, count, out + g * stride, stride);
    g += 1;
  }
}

// out[g][c, c + W CN) += sum over the `count` rows i of probs[g * stride + i] * vr[i][c, c + W CN), g < GN: the
// GN x CN output vectors stay in registers over the rows (independent FMA chains), each row is loaded once.
template <typename S, int GN, int CN, typename T>
static void accumulate_columns(const float* probs, int64_t stride, const T* const* vr, int64_t count,
                               int64_t dim, int64_t c, float* out) {
  typename S::V a[GN][CN];
  for (int g = 0; g < GN; ++g)
    for (int k = 0; k < CN; ++k) a[g][k] = S::load(out + g * dim + c + S::kWidth * k);
  for (int64_t i = 0; i < count; ++i) {
    typename S::V b[GN];
    for (int g = 0; g < GN; ++g) b[g] = S::broadcast(probs + g * stride + i);
    for (int k = 0; k < CN; ++k) {
      const typename S::V v = S::load(vr[i] + c + S::kWidth * k);
      for (int g = 0; g < GN; ++g) a[g][k] = S::fma(b[g], v, a[g][k]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int k = 0; k < CN; ++k) S::store(out + g * dim + c + S::kWidth * k, a[g][k]);
}

// accumulate_columns over every column of the GN output rows, CN vectors at a time.
template <typename S, int GN, int CN, typename T>
static void accumulate_values(const float* probs, int64_t stride, const T* const* vr, int64_t count,
                              int64_t dim, float* out) {
  int64_t c = 0;
  for (; c + S::kWidth * CN <= dim; c += S::kWidth * CN)
    accumulate_columns<S, GN, CN>(probs, stride, vr, count, dim, c, out);
  for (; c < dim; c += S::kWidth) accumulate_columns<S, GN, 1>(probs, stride, vr, count, dim, c, out);
}

constexpr int64_t kValueRows = 16;
constexpr int64_t kKeyPrefetch = 32;
constexpr int64_t kNextKeys = 32;

// Each group's scores at s[0, stride) replaced by their softmax (lanes at -inf give 0), with a head's sink logit in
// its denominator where the task has sinks; the outputs zeroed.
template <typename T>
static void softmax_rows(const Task<T>& t, float* scores, int64_t stride) {
  for (int64_t g = 0; g < t.group; ++g) {
    float* s = scores + g * stride;
    const float highest = t.sinks ? std::max(max_of(s, stride), t.sinks[g]) : max_of(s, stride);
    const float total = exp_in_place(s, stride, highest);
    const float sink = t.sinks ? std::exp(t.sinks[g] - highest) : 0.f;
    scale_in_place(s, stride, 1.f / (total + sink));
    std::fill(t.out + g * t.dim, t.out + (g + 1) * t.dim, 0.f);
  }
}

// The value pass: out[g] = sum over positions of probs[g] * value row, kValueRows rows at a time. Meanwhile the key
// rows of `next` (the thread's next task, or null) past its first kKeyPrefetch are prefetched, kNextKeys rows per
// kValueRows value rows, so that the memory keeps streaming while the value pass computes from the cache.
template <typename S, int Loc, typename T>
static void weigh_values(const Task<T>& t, const float* scores, int64_t stride, const Task<T>* next) {
  constexpr int kOneHeadVectors = static_cast<int>(64 / S::kWidth);  // 64 columns a pass for a lone head
  const T* rows[kValueRows];
  const int64_t dim = t.dim, n = t.length;
  int64_t ahead = next == nullptr ? 0 : next->first + kKeyPrefetch;
  for (int64_t j0 = t.first; j0 < n; j0 += kValueRows, ahead += kNextKeys) {
    const int64_t count = std::min<int64_t>(kValueRows, n - j0);
    for (int64_t i = 0; i < count; ++i) rows[i] = t.v + t.slots[j0 + i] * dim;
    for (int64_t j = j0 + kValueRows; j < std::min(j0 + 2 * kValueRows, n); ++j)
      prefetch_row<Loc>(t.v + t.slots[j] * dim, dim);
    if (next != nullptr)
      for (int64_t j = ahead; j < std::min(ahead + kNextKeys, next->length); ++j)
        prefetch_row<Loc>(next->k + next->slots[j] * dim, dim);
    const float* p = scores + (j0 - t.first);
    for (int64_t g = 0; g < t.group; g += 4) {
      float* out = t.out + g * dim;
      const float* pg = p + g * stride;
      switch (std::min<int64_t>(4, t.group - g)) {
        case 1: accumulate_values<S, 1, kOneHeadVectors>(pg, stride, rows, count, dim, out); break;
        case 2: accumulate_values<S, 2, 4>(pg, stride, rows, count, dim, out); break;
        case 3: accumulate_values<S, 3, 4>(pg, stride, rows, count, dim, out); break;
        default: accumulate_values<S, 4, 2>(pg, stride, rows, count, dim, out); break;
      }
    }
  }
}

// One task with S's lanes (head_dim a multiple of S::kWidth); `next` (or null): the thread's next task, whose key rows
// are prefetched from before the value pass on.
template <typename S, int Loc, typename T>
static void attend_simd(const Task<T>& t, const Task<T>* next, std::vector<float>& scores) {
  const int64_t dim = t.dim, first = t.first, n = t.length;
  const int64_t stride = (n - first + 7) / 8 * 8;
  scores.resize(t.group * stride);
  const T* rows[8];
  for (int64_t j = first; j < std::min(first + kKeyPrefetch, n); ++j) prefetch_row<Loc>(t.k + t.slots[j] * dim, dim);
  for (int64_t j = first; j < std::min(first + 8, n); ++j) prefetch_row<Loc>(t.v + t.slots[j] * dim, dim);
  for (int64_t j0 = first; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    for (int i = 0; i < 8; ++i) rows[i] = t.k + t.slots[j0 + std::min<int64_t>(i, count - 1)] * dim;
    for (int64_t j = j0 + kKeyPrefetch; j < std::min(j0 + kKeyPrefetch + 8, n); ++j)
      prefetch_row<Loc>(t.k + t.slots[j] * dim, dim);
    for (int64_t j = j0 + 8; j < std::min(j0 + 16, n); ++j) prefetch_row<Loc>(t.v + t.slots[j] * dim, dim);
    scores_of_rows<S>(t, rows, count, scores.data() + (j0 - first), stride);
  }
  for (int64_t j = first; j < std::min(first + kValueRows, n); ++j) prefetch_row<Loc>(t.v + t.slots[j] * dim, dim);
  if (next != nullptr)
    for (int64_t j = next->first; j < std::min(next->first + kKeyPrefetch, next->length); ++j)
      prefetch_row<Loc>(next->k + next->slots[j] * dim, dim);
  softmax_rows(t, scores.data(), stride);
  weigh_values<S, Loc>(t, scores.data(), stride, next);
}
#endif

// A task reading at most this many bytes of keys and values right after this thread's task of its request's previous
// row finds them in cache (L2 is 1-2 MB a core on current x86 servers) and prefetches nothing (`prefetch_row`).
constexpr int64_t kWarmBytes = 1 << 20;

// Whether row b follows a row of its own request and reads few enough bytes to find them in cache (`kWarmBytes`).
static inline bool follows_its_request(const int64_t* request, const int64_t* length, const int64_t* start,
                                       int64_t b, int64_t bytes_per_position) {
  return b > 0 && request[b - 1] == request[b] && (length[b] - start[b]) * bytes_per_position <= kWarmBytes;
}

// Chunks a thread in a step mixing rows from cache with rows from memory, taken by whichever thread is free (the
// cost model below is a guess). Elsewhere one a thread: a chunk's first task cannot prefetch while the previous
// chunk runs, which cost a decode step of 128 short rows 4-10%.
constexpr int64_t kChunksPerThread = 8;

// The bounds of contiguous ranges of [0, batch * kv_heads) tasks with about equal work each: one a thread, or
// kChunksPerThread a thread in a mixed step (rows alone of their request, decode rows, beside rows reading from
// cache). A row's work is the positions it reads plus a constant, kColdWeight times the positions for a row whose
// keys and values come from memory (a decode row; a prefill chunk's first row), not from the cache its request's
// previous row left them in: a mixed step would otherwise leave the thread with the decode rows behind.
static std::vector<int64_t> balanced_chunks(const int64_t* length, const int64_t* start, const int64_t* request,
                                            int64_t batch, int64_t kv_heads, int64_t bytes_per_position,
                                            int64_t threads) {
  constexpr int64_t kTaskCost = 16, kColdWeight = 4;
  std::vector<int64_t> cost(batch + 1, 0);
  int64_t warm_rows = 0, lone_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t positions = length[b] - start[b];
    const bool warm = follows_its_request(request, length, start, b, bytes_per_position);
    warm_rows += warm;
    lone_rows += !warm && (b + 1 == batch || request[b + 1] != request[b]);
    cost[b + 1] = cost[b] + positions * (warm ? 1 : kColdWeight) + kTaskCost;
  }
  const bool mixed = warm_rows > 0 && lone_rows > 0;
  const int64_t chunks = std::max<int64_t>(1, std::min(batch, mixed ? threads * kChunksPerThread : threads));
  std::vector<int64_t> bounds(chunks + 1, batch * kv_heads);
  bounds[0] = 0;
  for (int64_t p = 1, b = 0; p < chunks; ++p) {
    while (b < batch && cost[b + 1] * chunks <= cost[batch] * p) ++b;
    bounds[p] = b * kv_heads;
  }
  return bounds;
}

template <int Loc, typename T>
static void attend_tasks(const float* q, const T* k, const T* v, const int64_t* slot, const int64_t* length,
                         const int64_t* start, float* out, int64_t batch, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t num_slots, int64_t max_len, int64_t queries_per_request,
                         const int64_t* row_requests, float scale, float softcap, const float* sinks) {
  const int64_t group = heads / kv_heads, threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t bytes_per_position = dim * static_cast<int64_t>(2 * sizeof(T));
  std::vector<int64_t> request(batch);
  for (int64_t b = 0; b < batch; ++b) request[b] = row_requests ? row_requests[b] : b / queries_per_request;
  const auto bounds = balanced_chunks(length, start, request.data(), batch, kv_heads, bytes_per_position, threads);
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch_a, scratch_b;
    const auto make = [&](int64_t task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      return Task<T>{q + (b * heads + h * group) * dim, k + h * num_slots * dim, v + h * num_slots * dim,
                     slot + request[b] * max_len, start[b], length[b], group, dim, scale, softcap,
                     out + (b * heads + h * group) * dim, sinks ? sinks + h * group : nullptr};
    };
    for (int64_t chunk = next_chunk++; chunk < chunks; chunk = next_chunk++) {
      const int64_t begin = bounds[chunk], end = bounds[chunk + 1];
      for (int64_t task = begin; task < end; ++task) {
        const Task<T> t = make(task), following = make(std::min(task + 1, end - 1));
        const Task<T>* next = task + 1 < end ? &following : nullptr;
        const bool warm = task - kv_heads >= begin &&
                          follows_its_request(request.data(), length, start, task / kv_heads, bytes_per_position);
#ifdef CONTBATCH_AVX512
        if (dim % 16 == 0) {
          warm ? attend_simd<Lanes16, 0>(t, next, scratch_a) : attend_simd<Lanes16, Loc>(t, next, scratch_a);
          continue;
        }
#endif
#ifdef CONTBATCH_AVX2
        if (dim % 8 == 0) {
          warm ? attend_simd<Lanes8, 0>(t, next, scratch_a) : attend_simd<Lanes8, Loc>(t, next, scratch_a);
          continue;
        }
#endif
        attend_scalar<Loc>(t, scratch_a, scratch_b);
      }
    }
  });
}

// query: [R, H, D], R = B * queries_per_request rows, request b's queries at rows b * queries_per_request on;
// key_cache, value_cache: [KVH, S, D] (head-major slots), float32 or bfloat16, of the query's dtype; slots: [B, L]
// cache slot of each request's positions 0..L-1; lengths: [R] the keys each row attends to (positions below
// lengths[r], causal prefill rows included); first: [R] each row's first visible position (sliding window). A
// decode step is one query per request. `row_requests` ([R] int64), when given, names each row's request (a ragged
// batch: any rows of any requests, a whole step in one call; `queries_per_request` is then ignored). Returns
// [R, H, D] in the query's dtype. `sinks` ([H] float32), when given, adds each head's sink logit to its softmax's
// denominator (attention sinks: gpt-oss's `s_aux`).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& slots,
                                  const at::Tensor& lengths, const at::Tensor& first, double scale,
                                  double softcap, int64_t queries_per_request,
                                  const c10::optional<at::Tensor>& row_requests,
                                  const c10::optional<at::Tensor>& sinks) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype, "cache of the query's dtype");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(slots.is_contiguous() && slots.dtype() == at::kLong);
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), num_slots = key_cache.size(1), max_len = slots.size(1);
  const bool ragged = row_requests.has_value() && row_requests->defined();
  TORCH_CHECK(slots.dim() == 2, "slots: [requests, L]");
  TORCH_CHECK(ragged || (queries_per_request >= 1 && slots.size(0) * queries_per_request == batch), "slots for ",
              batch, " query rows, ", queries_per_request, " per request, got ", slots.size(0), " rows");
  const int64_t* request_of = nullptr;
  if (ragged) {
    TORCH_CHECK(row_requests->numel() == batch && row_requests->dtype() == at::kLong &&
                    row_requests->is_contiguous(), "row_requests: [R] contiguous int64, a request for each row");
    request_of = row_requests->data_ptr<int64_t>();
    for (int64_t r = 0; r < batch; ++r)
      TORCH_CHECK(request_of[r] >= 0 && request_of[r] < slots.size(0), "row ", r, " names request ", request_of[r],
                  " of ", slots.size(0));
  }
  TORCH_CHECK(lengths.numel() == batch && first.numel() == batch, "a length and a first position for each row");
  TORCH_CHECK(lengths.is_contiguous() && first.is_contiguous(), "contiguous lengths and first positions");
  const bool has_sinks = sinks.has_value() && sinks->defined();
  TORCH_CHECK(!has_sinks || (sinks->numel() == heads && sinks->scalar_type() == at::kFloat &&
                             sinks->is_contiguous()), "sinks: [H] contiguous float32, one for each query head");
  const float* sink = has_sinks ? sinks->data_ptr<float>() : nullptr;
  const at::Tensor q32 = query.to(at::kFloat);
  auto output = at::empty_like(q32);
  const float* q = q32.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* start = first.data_ptr<int64_t>();
  float* out = output.data_ptr<float>();
  const float scale32 = static_cast<float>(scale), softcap32 = static_cast<float>(softcap);
  const auto attend = [&](const auto* k, const auto* v) {
    const auto run = [&](auto locality) {
      attend_tasks<decltype(locality)::value>(q, k, v, slot, length, start, out, batch, heads, kv_heads, dim,
                                              num_slots, max_len, queries_per_request, request_of, scale32,
                                              softcap32, sink);
    };
    if (attention_prefetch() == 2) run(std::integral_constant<int, 2>{});
    else run(std::integral_constant<int, 3>{});
  };
  if (dtype == at::kFloat) {
    attend(key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
    return output;
  }
  attend(key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>());
  return output.to(dtype);
}
