// Paged attention for requests that compute one query token (decode), on CPU, float32.
//
// Reads each request's keys and values straight from the paged cache (no gathered copy), one task per
// (request, kv head), the query heads of a GQA group sharing every key and value row they read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

// Blocks of the cache are scattered: the hardware prefetcher stops at each block's end, so every row is fetched
// kPrefetchAhead positions before it is read (prefetching changes no arithmetic).
constexpr int64_t kPrefetchAhead = 8;

static inline void prefetch_row(const float* row, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d, 0, 3);
}

// query: [B, H, D]; key_cache, value_cache: [KVH, S, D] (head-major slots); slots: [B, L] cache slot of each
// request's positions 0..L-1; lengths: [B] keys each request attends to; first: [B] first visible position
// (sliding window). Returns [B, H, D].
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                                     const torch::Tensor& value_cache, const torch::Tensor& slots,
                                     const torch::Tensor& lengths, const torch::Tensor& first, double scale,
                                     double softcap) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && key_cache.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(slots.is_contiguous() && slots.dtype() == torch::kInt64);
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), num_slots = key_cache.size(1), max_len = slots.size(1);
  const int64_t group = heads / kv_heads;
  auto output = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* k = key_cache.data_ptr<float>();
  const float* v = value_cache.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* start = first.data_ptr<int64_t>();
  float* out = output.data_ptr<float>();
  const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * max_len), acc(group * dim), row_max(group), row_sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t n = length[b], f = start[b];
      const float* qb = q + (b * heads + h * group) * dim;
      const float* kh = k + h * num_slots * dim;
      const float* vh = v + h * num_slots * dim;
      std::fill(row_max.begin(), row_max.end(), -INFINITY);
      for (int64_t j = f; j < n; ++j) {
        const float* kr = kh + slot[b * max_len + j] * dim;
        if (j + kPrefetchAhead < n) prefetch_row(kh + slot[b * max_len + j + kPrefetchAhead] * dim, dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qb + g * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qg[d] * kr[d];
          s *= sc;
          if (cap > 0.f) s = cap * std::tanh(s / cap);
          scores[g * max_len + j] = s;
          row_max[g] = std::max(row_max[g], s);
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      for (int64_t j = f; j < n; ++j) {
        const float* vr = vh + slot[b * max_len + j] * dim;
        if (j + kPrefetchAhead < n) prefetch_row(vh + slot[b * max_len + j + kPrefetchAhead] * dim, dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = std::exp(scores[g * max_len + j] - row_max[g]);
          row_sum[g] += p;
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * vr[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + (b * heads + h * group + g) * dim;
        const float inv = 1.f / row_sum[g];
        for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] * inv;
      }
    }
  });
  return output;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
}
