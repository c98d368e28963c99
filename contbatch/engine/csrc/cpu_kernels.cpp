// contbatch's CPU kernels: writing a layer's new K/V rows into the paged cache, and paged attention for
// requests that compute one query token (decode), float32.
//
// The decode kernel reads each request's keys and values straight from the paged cache (no gathered copy), one task per
// (request, kv head), the query heads of a GQA group sharing every key and value row they read.
//
// With AVX2 + FMA and a head_dim that is a multiple of 8, a task walks its positions 8 at a time in one pass
// (online softmax): the 8 scores of each query head come out of 8 vector accumulators in one reduction, exp is
// a vector polynomial, and values are accumulated 8 rows per load of the output. Elsewhere a scalar two-pass
// loop computes the same function.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CONTBATCH_AVX2 1
#endif

// Blocks of the cache are scattered: the hardware prefetcher stops at each block's end, so every row is fetched
// kPrefetchAhead positions before it is read (prefetching changes no arithmetic).
constexpr int64_t kPrefetchAhead = 8;

static inline void prefetch_row(const float* row, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) __builtin_prefetch(row + d, 0, 3);
}

struct Task {
  const float* q;        // [group, dim] the query heads of one kv head
  const float* k;        // this kv head's key slots
  const float* v;        // this kv head's value slots
  const int64_t* slots;  // the request's slot of each position
  int64_t first, length, group, dim;
  float scale, softcap;
  float* out;            // [group, dim]
};

static void attend_scalar(const Task& t, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t group = t.group, dim = t.dim, n = t.length, f = t.first;
  scores.assign(group * n, 0.f);
  acc.assign(group * dim, 0.f);
  std::vector<float> row_max(group, -INFINITY), row_sum(group, 0.f);
  for (int64_t j = f; j < n; ++j) {
    const float* kr = t.k + t.slots[j] * dim;
    if (j + kPrefetchAhead < n) prefetch_row(t.k + t.slots[j + kPrefetchAhead] * dim, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = t.q + g * dim;
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qg[d] * kr[d];
      s *= t.scale;
      if (t.softcap > 0.f) s = t.softcap * std::tanh(s / t.softcap);
      scores[g * n + j] = s;
      row_max[g] = std::max(row_max[g], s);
    }
  }
  for (int64_t j = f; j < n; ++j) {
    const float* vr = t.v + t.slots[j] * dim;
    if (j + kPrefetchAhead < n) prefetch_row(t.v + t.slots[j + kPrefetchAhead] * dim, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = std::exp(scores[g * n + j] - row_max[g]);
      row_sum[g] += p;
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * vr[d];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) t.out[g * dim + d] = acc[g * dim + d] / row_sum[g];
}

#ifdef CONTBATCH_AVX2
// exp for x <= 88.37 (Cephes' single-precision polynomial, ~1 ulp); lanes below -87.3 give ~0.
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

// lane i of the result = the sum of the lanes of a[i]
static inline __m256 reduce8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

static inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax(__m256 x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// The 8 scores of query head `qg` against rows `kr`, scaled (and soft-capped), lanes >= count at -inf.
static inline __m256 scores8(const float* qg, const float* const* kr, int64_t dim, const Task& t, int64_t count) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < dim; c += 8) {
    const __m256 qv = _mm256_loadu_ps(qg + c);
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[i] + c), a[i]);
  }
  __m256 s = _mm256_mul_ps(reduce8(a), _mm256_set1_ps(t.scale));
  if (t.softcap > 0.f) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, s);
    for (float& x : lanes) x = t.softcap * std::tanh(x / t.softcap);
    s = _mm256_load_ps(lanes);
  }
  const __m256 valid = _mm256_cmp_ps(_mm256_set_ps(7, 6, 5, 4, 3, 2, 1, 0), _mm256_set1_ps(float(count)), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, valid);
}

static void attend_avx2(const Task& t, std::vector<float>& acc, std::vector<float>& probs) {
  const int64_t group = t.group, dim = t.dim, n = t.length;
  acc.assign(group * dim, 0.f);
  probs.resize(group * 8);
  std::vector<float> row_max(group, -INFINITY), row_sum(group, 0.f);
  const float* kr[8];
  const float* vr[8];
  for (int64_t j0 = t.first; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    for (int i = 0; i < 8; ++i) {
      const int64_t slot = t.slots[j0 + std::min<int64_t>(i, count - 1)];
      kr[i] = t.k + slot * dim;
      vr[i] = t.v + slot * dim;
    }
    for (int64_t j = j0 + 16; j < std::min(j0 + 16 + kPrefetchAhead, n); ++j) {
      prefetch_row(t.k + t.slots[j] * dim, dim);
      prefetch_row(t.v + t.slots[j] * dim, dim);
    }
    for (int64_t g = 0; g < group; ++g) {
      const __m256 s = scores8(t.q + g * dim, kr, dim, t, count);
      const float new_max = std::max(row_max[g], hmax(s));
      const float correction = std::exp(row_max[g] - new_max);
      const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(s, _mm256_set1_ps(new_max))),
                                     _mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
      row_max[g] = new_max;
      row_sum[g] = row_sum[g] * correction + hsum(p);
      _mm256_storeu_ps(probs.data() + g * 8, p);
      float* ag = acc.data() + g * dim;
      if (correction != 1.f)
        for (int64_t c = 0; c < dim; c += 8)
          _mm256_storeu_ps(ag + c, _mm256_mul_ps(_mm256_loadu_ps(ag + c), _mm256_set1_ps(correction)));
    }
    for (int64_t g = 0; g < group; ++g) {
      __m256 pb[8];
      for (int i = 0; i < 8; ++i) pb[i] = _mm256_broadcast_ss(probs.data() + g * 8 + i);
      float* ag = acc.data() + g * dim;
      for (int64_t c = 0; c < dim; c += 8) {
        __m256 a = _mm256_loadu_ps(ag + c);
        for (int i = 0; i < 8; ++i) a = _mm256_fmadd_ps(pb[i], _mm256_loadu_ps(vr[i] + c), a);
        _mm256_storeu_ps(ag + c, a);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m256 inv = _mm256_set1_ps(1.f / row_sum[g]);
    for (int64_t c = 0; c < dim; c += 8)
      _mm256_storeu_ps(t.out + g * dim + c, _mm256_mul_ps(_mm256_loadu_ps(acc.data() + g * dim + c), inv));
  }
}
#endif

// cache: [H, S, D] contiguous; rows: [H, T, D] with a contiguous last dim; slots: [T] int64, each in [0, S).
// Stores row (h, t) at cache (h, slots[t]) (of rows sharing a slot, one is kept). A decode step writes one row per request into lines no core
// has touched since the previous step: ordinary stores first read each line from memory. Where rows are whole
// 32-byte vectors the rows are written with non-temporal stores instead, which skip that read.
void write_rows(torch::Tensor cache, const torch::Tensor& rows, const torch::Tensor& slots) {
  TORCH_CHECK(cache.is_contiguous() && rows.dim() == 3 && rows.stride(2) == 1 && cache.dim() == 3);
  TORCH_CHECK(rows.dtype() == cache.dtype() && slots.dtype() == torch::kInt64 && slots.is_contiguous());
  TORCH_CHECK(rows.size(0) == cache.size(0) && rows.size(1) == slots.size(0) && rows.size(2) == cache.size(2));
  const int64_t heads = cache.size(0), num_slots = cache.size(1), count = rows.size(1);
  const int64_t row_bytes = cache.size(2) * cache.element_size(), item = rows.element_size();
  const int64_t head_stride = rows.stride(0) * item, row_stride = rows.stride(1) * item;
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(rows.data_ptr());
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < count; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is outside the cache's ", num_slots);
#ifdef CONTBATCH_AVX2
  const bool stream = row_bytes % 32 == 0 && reinterpret_cast<uintptr_t>(dst) % 32 == 0;
#endif
  at::parallel_for(0, heads * count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / count, t = i % count;
      char* d = dst + (h * num_slots + slot[t]) * row_bytes;
      const char* s = src + h * head_stride + t * row_stride;
#ifdef CONTBATCH_AVX2
      if (stream) {
        for (int64_t c = 0; c < row_bytes; c += 32)
          _mm256_stream_si256(reinterpret_cast<__m256i*>(d + c),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c)));
        continue;
      }
#endif
      std::memcpy(d, s, row_bytes);
    }
#ifdef CONTBATCH_AVX2
    _mm_sfence();
#endif
  });
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
  auto output = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* k = key_cache.data_ptr<float>();
  const float* v = value_cache.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* start = first.data_ptr<int64_t>();
  float* out = output.data_ptr<float>();
  const int64_t group = heads / kv_heads;

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch_a, scratch_b;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const Task t{q + (b * heads + h * group) * dim, k + h * num_slots * dim, v + h * num_slots * dim,
                   slot + b * max_len, start[b], length[b], group, dim, static_cast<float>(scale),
                   static_cast<float>(softcap), out + (b * heads + h * group) * dim};
#ifdef CONTBATCH_AVX2
      if (dim % 8 == 0) {
        attend_avx2(t, scratch_a, scratch_b);
        continue;
      }
#endif
      attend_scalar(t, scratch_a, scratch_b);
    }
  });
  return output;
}

// How many threads at::parallel_for runs this extension's loops on (1 when it was built without OpenMP).
int64_t parallel_threads() {
  std::vector<int> used(at::get_num_threads() + 1, 0);
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { used[at::get_thread_num()] = 1; });
  return std::count(used.begin(), used.end(), 1);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_rows", &write_rows, "store K/V rows at cache slots");
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for uses in this extension");
}
