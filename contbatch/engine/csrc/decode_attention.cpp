// contbatch's paged attention on CPU, for query rows that each attend to their own range of one request's keys: a
// decode step's one query per request, or the causal rows of a prefill chunk (row i of a chunk starting at position
// s reads positions up to s + i, in the cache already, as the layer writes its new keys first). The cache holds
// float32 or bfloat16 (each bfloat16 row widened to float32 as it is read, exactly); the arithmetic is float32
// either way, and a bfloat16 query's output is rounded to bfloat16 once, at the end.
//
// The kernel reads each request's keys and values straight from the paged cache (no gathered copy), one task per
// (query row, kv head), the query heads of a GQA group sharing every key and value row they read. A request's
// consecutive rows of one first position (a prefill chunk's) are taken up to 16 at a time for a kv head, each key and
// value row read once for them (attention_runs.h). The work is cut into contiguous ranges of about equal work, one a
// thread, or several a thread, taken in turn by whichever thread is free, in a step mixing decode rows with a prefill
// chunk's (`balanced_chunks`).
//
// With AVX2 + FMA (8 lanes) or AVX-512 (16 lanes, where head_dim is a multiple of 16), a task makes two passes: the
// first computes every score, then an exact softmax over them (exp as a vector polynomial); the second sums the value
// rows weighted by the probabilities, 16 rows at a time with the output rows held in registers, each output element
// one sum over the positions in order, whatever the width. A thread runs its tasks as a pipeline, the value pass of
// one beside the key pass of the next (attention_pipeline.h, which says how the scores are computed for each
// cache and CPU). Elsewhere a scalar two-pass loop computes the same function. Rows are prefetched to L1 or to L2
// (`set_attention_prefetch`): which streams faster depends on the CPU, and contbatch measures it once a machine
// (engine/kernel_tuning.py). A task right after its thread's task of the same request's previous row (a prefill
// chunk) prefetches nothing: its rows are in cache (`kWarmBytes`).
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_pipeline.h"
#include "attention_runs.h"
#include "attention_task.h"

static std::atomic<int64_t> prefetch_level{1};

// Where the kernel prefetches rows to: cache level 1 (`prefetcht0`) or 2 (`prefetcht1`); no arithmetic changes.
void set_attention_prefetch(int64_t level) {
  TORCH_CHECK(level == 1 || level == 2, "attention prefetch: cache level 1 or 2, got ", level);
  prefetch_level.store(level, std::memory_order_relaxed);
}

int64_t attention_prefetch() { return prefetch_level.load(std::memory_order_relaxed); }

// How this build computes a bfloat16 cache's scores on this CPU (head_dim a multiple of 32, at most 16 query heads
// a KV head): "tiles" (AMX), "pairs" (AVX512-BF16), "lanes" (float32 lanes, AVX2 or AVX-512) or "scalar".
std::string attention_bfloat16_scores() {
#ifdef CONTBATCH_TILES
  if (tiles_permitted()) return "tiles";
#endif
#if defined(CONTBATCH_PAIRS)
  return "pairs";
#elif defined(CONTBATCH_AVX2)
  return "lanes";
#else
  return "scalar";
#endif
}

template <int Loc, typename T>
static void attend_scalar(const Task<T>& t, std::vector<float>& scores, std::vector<float>& acc,
                          std::vector<float>& query) {
  const int64_t group = t.group, dim = t.dim, n = t.length, f = t.first;
  scores.assign(group * n, 0.f);
  acc.assign(group * dim, 0.f);
  query.resize(group * dim);
  widen_query(t, query.data());
  std::vector<float> row_max(group, -INFINITY), row_sum(group, 0.f);
  for (int64_t j = f; j < n; ++j) {
    const T* kr = t.k + t.slots[j] * dim;
    if (j + kPrefetchAhead < n) prefetch_row<Loc>(t.k + t.slots[j + kPrefetchAhead] * dim, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = query.data() + g * dim;
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
    for (int64_t d = 0; d < dim; ++d) t.dest[g * dim + d] = static_cast<T>(acc[g * dim + d] / row_sum[g]);
}


// A task reading at most this many bytes of keys and values right after this thread's task of its request's previous
// row finds them in cache (L2 is 1-2 MB a core on current x86 servers) and prefetches nothing (`prefetch_row`).
constexpr int64_t kWarmBytes = 1 << 20;

// Whether row b follows a row of its own request and reads few enough bytes to find them in cache (`kWarmBytes`).
static inline bool follows_its_request(const int64_t* request, const int64_t* length, const int64_t* start,
                                       int64_t b, int64_t bytes_per_position) {
  return b > 0 && request[b - 1] == request[b] && (length[b] - start[b]) * bytes_per_position <= kWarmBytes;
}

// Chunks a thread in a step mixing rows from cache with rows from memory, taken by whichever thread is free (the
// cost model below is a guess). Elsewhere one a thread.
constexpr int64_t kChunksPerThread = 8;

// The bounds of contiguous ranges of the [0, runs * kv_heads) units (a run of rows, `row_runs`, for one kv head) with
// about equal work each: one a thread, or kChunksPerThread a thread in a mixed step (rows alone of their request,
// decode rows, beside rows reading from cache). A row's work is the positions it reads plus a constant, kColdWeight
// times the positions for a row whose keys and values come from memory (a decode row; a prefill chunk's first row),
// not from the cache its request's previous row left them in: a mixed step would otherwise leave the thread with the
// decode rows behind.
static std::vector<int64_t> balanced_chunks(const int64_t* length, const int64_t* start, const int64_t* request,
                                            const std::vector<int64_t>& runs, int64_t kv_heads,
                                            int64_t bytes_per_position, int64_t threads) {
  constexpr int64_t kTaskCost = 16, kColdWeight = 4;
  const int64_t batch = runs.back(), count = static_cast<int64_t>(runs.size()) - 1;
  std::vector<int64_t> cost(count + 1, 0);
  int64_t warm_rows = 0, lone_rows = 0;
  for (int64_t i = 0; i < count; ++i) {
    cost[i + 1] = cost[i];
    for (int64_t b = runs[i]; b < runs[i + 1]; ++b) {
      const bool warm = follows_its_request(request, length, start, b, bytes_per_position);
      warm_rows += warm;
      lone_rows += !warm && (b + 1 == batch || request[b + 1] != request[b]);
      cost[i + 1] += (length[b] - start[b]) * (warm ? 1 : kColdWeight) + kTaskCost;
    }
  }
  const bool mixed = warm_rows > 0 && lone_rows > 0;
  const int64_t chunks = std::max<int64_t>(1, std::min(count, mixed ? threads * kChunksPerThread : threads));
  std::vector<int64_t> bounds(chunks + 1, count * kv_heads);
  bounds[0] = 0;
  for (int64_t p = 1, i = 0; p < chunks; ++p) {
    while (i < count && cost[i + 1] * chunks <= cost[count] * p) ++i;
    bounds[p] = i * kv_heads;
  }
  return bounds;
}

template <int Loc, typename T>
static void attend_tasks(const T* q, int64_t q_row_stride, int64_t q_head_stride, const T* k, const T* v,
                         const int64_t* slot, const int64_t* length, const int64_t* start, T* out, int64_t batch,
                         int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t num_slots, int64_t max_len, int64_t queries_per_request,
                         const int64_t* row_requests, float scale, float softcap, const float* sinks) {
  const int64_t group = heads / kv_heads, threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t bytes_per_position = dim * static_cast<int64_t>(2 * sizeof(T));
  std::vector<int64_t> request(batch);
  for (int64_t b = 0; b < batch; ++b) request[b] = row_requests ? row_requests[b] : b / queries_per_request;
  const auto runs = row_runs(request.data(), start, batch);
  const auto bounds = balanced_chunks(length, start, request.data(), runs, kv_heads, bytes_per_position, threads);
  const int64_t chunks = static_cast<int64_t>(bounds.size()) - 1;
  std::atomic<int64_t> next_chunk{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t chunk = next_chunk++, unit = chunk < chunks ? bounds[chunk] : 0;
    const auto next = [&](std::vector<Task<T>>& tasks) -> int64_t {
      while (chunk < chunks && unit >= bounds[chunk + 1]) {
        chunk = next_chunk++;
        if (chunk < chunks) unit = bounds[chunk];
      }
      if (chunk >= chunks) return 0;
      const int64_t run = unit / kv_heads, h = unit % kv_heads, b0 = runs[run];
      for (int64_t b = b0; b < runs[run + 1]; ++b) {
        const bool warm = b > b0 || (unit - kv_heads >= bounds[chunk] &&
                                     follows_its_request(request.data(), length, start, b, bytes_per_position));
        tasks[b - b0] = Task<T>{q + b * q_row_stride + h * group * q_head_stride, q_head_stride,
                                k + h * num_slots * dim, v + h * num_slots * dim, slot + request[b] * max_len,
                                start[b], length[b], group, dim, scale, softcap, out + (b * heads + h * group) * dim,
                                sinks ? sinks + h * group : nullptr, warm, nullptr, nullptr};
      }
      ++unit;
      return runs[run + 1] - b0;
    };
#ifdef CONTBATCH_TILES
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      if (dim % kPairWidth == 0 && group <= kTileRows && tiles_permitted()) {
        const TileScope tiles(group);
        return attend_all<Lanes16, Scores::kTiles, Loc, T>(next);
      }
#endif
#ifdef CONTBATCH_PAIRS
    if constexpr (std::is_same_v<T, c10::BFloat16>)
      if (dim % kPairWidth == 0) return attend_all<Lanes16, Scores::kPairs, Loc, T>(next);
#endif
#ifdef CONTBATCH_AVX512
    if (dim % 16 == 0) return attend_all<Lanes16, Scores::kLanes, Loc, T>(next);
#endif
#ifdef CONTBATCH_AVX2
    if (dim % 8 == 0) return attend_all<Lanes8, Scores::kLanes, Loc, T>(next);
#endif
    std::vector<float> scores, acc, query;
    std::vector<Task<T>> tasks(kRunRows);
    for (int64_t count; (count = next(tasks)) > 0;)
      for (int64_t r = 0; r < count; ++r) attend_scalar<Loc>(tasks[r], scores, acc, query);
  });
}

// query: [R, H, D] at any strides but the last (a transposed view is read in place), R = B * queries_per_request
// rows, request b's queries at rows b * queries_per_request on;
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
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query: [R, H, D], its last dimension contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches");
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
  auto output = at::empty({batch, heads, dim}, query.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* start = first.data_ptr<int64_t>();
  const float scale32 = static_cast<float>(scale), softcap32 = static_cast<float>(softcap);
  const auto attend = [&](const auto* k, const auto* v) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(k)>>;
    const auto run = [&](auto locality) {
      attend_tasks<decltype(locality)::value>(query.data_ptr<T>(), query.stride(0), query.stride(1), k, v, slot,
                                              length, start, output.data_ptr<T>(), batch, heads, kv_heads, dim,
                                              num_slots, max_len, queries_per_request, request_of, scale32,
                                              softcap32, sink);
    };
    if (attention_prefetch() == 2) run(std::integral_constant<int, 2>{});
    else run(std::integral_constant<int, 3>{});
  };
  if (dtype == at::kFloat) attend(key_cache.data_ptr<float>(), value_cache.data_ptr<float>());
  else attend(key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>());
  return output;
}
