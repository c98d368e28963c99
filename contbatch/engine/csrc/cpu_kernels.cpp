// contbatch's CPU kernels: writing a layer's new K/V rows into the paged cache, and paged attention for
// requests that compute one query token (decode). The cache holds float32 or bfloat16 (each bfloat16 row widened to
// float32 as it is read, exactly); the arithmetic is float32 either way, and a bfloat16 query's output is rounded to
// bfloat16 once, at the end.
//
// The decode kernel reads each request's keys and values straight from the paged cache (no gathered copy), one task per
// (request, kv head), the query heads of a GQA group sharing every key and value row they read.
//
// With AVX2 + FMA and a head_dim that is a multiple of 8, a task makes two passes. The first computes every score
// (8 positions of one query head per reduction, exp as a vector polynomial), then an exact softmax over them; the
// second sums the value rows weighted by the probabilities, 16 rows at a time with the output rows held in
// registers. Each key row is prefetched 32 positions before it is read, each value row during the key pass.
// Elsewhere a scalar two-pass loop computes the same function.
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

template <typename T>
static inline void prefetch_row(const T* row, int64_t dim) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(T));
  for (int64_t d = 0; d < dim; d += kLine) __builtin_prefetch(row + d, 0, 3);
}

template <typename T>
struct Task {
  const float* q;        // [group, dim] the query heads of one kv head
  const T* k;            // this kv head's key slots
  const T* v;            // this kv head's value slots
  const int64_t* slots;  // the request's slot of each position
  int64_t first, length, group, dim;
  float scale, softcap;
  float* out;            // [group, dim]
};

template <typename T>
static void attend_scalar(const Task<T>& t, std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t group = t.group, dim = t.dim, n = t.length, f = t.first;
  scores.assign(group * n, 0.f);
  acc.assign(group * dim, 0.f);
  std::vector<float> row_max(group, -INFINITY), row_sum(group, 0.f);
  for (int64_t j = f; j < n; ++j) {
    const T* kr = t.k + t.slots[j] * dim;
    if (j + kPrefetchAhead < n) prefetch_row(t.k + t.slots[j + kPrefetchAhead] * dim, dim);
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
  for (int64_t j = f; j < n; ++j) {
    const T* vr = t.v + t.slots[j] * dim;
    if (j + kPrefetchAhead < n) prefetch_row(t.v + t.slots[j + kPrefetchAhead] * dim, dim);
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
// 8 consecutive elements of a cache row as float32.
static inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }

static inline __m256 load8(const c10::BFloat16* x) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

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
template <typename T>
static inline __m256 scores8(const float* qg, const T* const* kr, int64_t dim, const Task<T>& t, int64_t count) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < dim; c += 8) {
    const __m256 qv = _mm256_loadu_ps(qg + c);
    for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qv, load8(kr[i] + c), a[i]);
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

// out[g][c, c + 8 CN) += sum over the `count` rows i of probs[g * stride + i] * vr[i][c, c + 8 CN), g < GN: the
// GN x CN output vectors stay in registers over the rows (independent FMA chains), each row is loaded once.
template <int GN, int CN, typename T>
static void accumulate_columns(const float* probs, int64_t stride, const T* const* vr, int64_t count,
                               int64_t dim, int64_t c, float* out) {
  __m256 a[GN][CN];
  for (int g = 0; g < GN; ++g)
    for (int k = 0; k < CN; ++k) a[g][k] = _mm256_loadu_ps(out + g * dim + c + 8 * k);
  for (int64_t i = 0; i < count; ++i) {
    __m256 b[GN];
    for (int g = 0; g < GN; ++g) b[g] = _mm256_broadcast_ss(probs + g * stride + i);
    for (int k = 0; k < CN; ++k) {
      const __m256 v = load8(vr[i] + c + 8 * k);
      for (int g = 0; g < GN; ++g) a[g][k] = _mm256_fmadd_ps(b[g], v, a[g][k]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int k = 0; k < CN; ++k) _mm256_storeu_ps(out + g * dim + c + 8 * k, a[g][k]);
}

// accumulate_columns over every column of the GN output rows, CN vectors at a time.
template <int GN, int CN, typename T>
static void accumulate_values(const float* probs, int64_t stride, const T* const* vr, int64_t count,
                              int64_t dim, float* out) {
  int64_t c = 0;
  for (; c + 8 * CN <= dim; c += 8 * CN) accumulate_columns<GN, CN>(probs, stride, vr, count, dim, c, out);
  for (; c < dim; c += 8) accumulate_columns<GN, 1>(probs, stride, vr, count, dim, c, out);
}

constexpr int64_t kValueRows = 16;
constexpr int64_t kKeyPrefetch = 32;

template <typename T>
static void attend_avx2(const Task<T>& t, std::vector<float>& scores, std::vector<float>&) {
  const int64_t group = t.group, dim = t.dim, first = t.first, n = t.length;
  const int64_t stride = (n - first + 7) / 8 * 8;
  scores.resize(group * stride);
  const T* rows[kValueRows];
  for (int64_t j = first; j < std::min(first + kKeyPrefetch, n); ++j) prefetch_row(t.k + t.slots[j] * dim, dim);
  for (int64_t j = first; j < std::min(first + 8, n); ++j) prefetch_row(t.v + t.slots[j] * dim, dim);
  for (int64_t j0 = first; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    for (int i = 0; i < 8; ++i) rows[i] = t.k + t.slots[j0 + std::min<int64_t>(i, count - 1)] * dim;
    for (int64_t j = j0 + kKeyPrefetch; j < std::min(j0 + kKeyPrefetch + 8, n); ++j)
      prefetch_row(t.k + t.slots[j] * dim, dim);
    for (int64_t j = j0 + 8; j < std::min(j0 + 16, n); ++j) prefetch_row(t.v + t.slots[j] * dim, dim);
    for (int64_t g = 0; g < group; ++g)
      _mm256_storeu_ps(scores.data() + g * stride + (j0 - first), scores8(t.q + g * dim, rows, dim, t, count));
  }
  for (int64_t j = first; j < std::min(first + kValueRows, n); ++j) prefetch_row(t.v + t.slots[j] * dim, dim);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * stride;
    __m256 high = _mm256_set1_ps(-INFINITY);
    for (int64_t c = 0; c < stride; c += 8) high = _mm256_max_ps(high, _mm256_loadu_ps(s + c));
    const __m256 top = _mm256_set1_ps(hmax(high)), none = _mm256_set1_ps(-INFINITY);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t c = 0; c < stride; c += 8) {
      const __m256 x = _mm256_loadu_ps(s + c);
      const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(x, top)), _mm256_cmp_ps(x, none, _CMP_NEQ_OQ));
      _mm256_storeu_ps(s + c, p);
      sum = _mm256_add_ps(sum, p);
    }
    const __m256 inv = _mm256_set1_ps(1.f / hsum(sum));
    for (int64_t c = 0; c < stride; c += 8) _mm256_storeu_ps(s + c, _mm256_mul_ps(_mm256_loadu_ps(s + c), inv));
    std::fill(t.out + g * dim, t.out + (g + 1) * dim, 0.f);
  }
  for (int64_t j0 = first; j0 < n; j0 += kValueRows) {
    const int64_t count = std::min<int64_t>(kValueRows, n - j0);
    for (int64_t i = 0; i < count; ++i) rows[i] = t.v + t.slots[j0 + i] * dim;
    for (int64_t j = j0 + kValueRows; j < std::min(j0 + 2 * kValueRows, n); ++j)
      prefetch_row(t.v + t.slots[j] * dim, dim);
    const float* p = scores.data() + (j0 - first);
    for (int64_t g = 0; g < group; g += 4) {
      float* out = t.out + g * dim;
      const float* pg = p + g * stride;
      switch (std::min<int64_t>(4, group - g)) {
        case 1: accumulate_values<1, 8>(pg, stride, rows, count, dim, out); break;
        case 2: accumulate_values<2, 4>(pg, stride, rows, count, dim, out); break;
        case 3: accumulate_values<3, 4>(pg, stride, rows, count, dim, out); break;
        default: accumulate_values<4, 2>(pg, stride, rows, count, dim, out); break;
      }
    }
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

template <typename T>
static void decode_tasks(const float* q, const T* k, const T* v, const int64_t* slot, const int64_t* length,
                         const int64_t* start, float* out, int64_t batch, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t num_slots, int64_t max_len, float scale, float softcap) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch_a, scratch_b;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const Task<T> t{q + (b * heads + h * group) * dim, k + h * num_slots * dim, v + h * num_slots * dim,
                      slot + b * max_len, start[b], length[b], group, dim, scale, softcap,
                      out + (b * heads + h * group) * dim};
#ifdef CONTBATCH_AVX2
      if (dim % 8 == 0) {
        attend_avx2(t, scratch_a, scratch_b);
        continue;
      }
#endif
      attend_scalar(t, scratch_a, scratch_b);
    }
  });
}

// query: [B, H, D]; key_cache, value_cache: [KVH, S, D] (head-major slots), float32 or bfloat16, of the query's
// dtype; slots: [B, L] cache slot of each request's positions 0..L-1; lengths: [B] keys each request attends to;
// first: [B] first visible position (sliding window). Returns [B, H, D] in the query's dtype.
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                                     const torch::Tensor& value_cache, const torch::Tensor& slots,
                                     const torch::Tensor& lengths, const torch::Tensor& first, double scale,
                                     double softcap) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype, "cache of the query's dtype");
  TORCH_CHECK(query.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous());
  TORCH_CHECK(slots.is_contiguous() && slots.dtype() == torch::kInt64);
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(0), num_slots = key_cache.size(1), max_len = slots.size(1);
  const torch::Tensor q32 = query.to(torch::kFloat32);
  auto output = torch::empty_like(q32);
  const float* q = q32.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* start = first.data_ptr<int64_t>();
  float* out = output.data_ptr<float>();
  const float scale32 = static_cast<float>(scale), softcap32 = static_cast<float>(softcap);
  if (dtype == torch::kFloat32) {
    decode_tasks(q, key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), slot, length, start, out, batch, heads,
                 kv_heads, dim, num_slots, max_len, scale32, softcap32);
    return output;
  }
  decode_tasks(q, key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>(), slot, length, start,
               out, batch, heads, kv_heads, dim, num_slots, max_len, scale32, softcap32);
  return output.to(dtype);
}

// The index of the first maximal element of x[0, n), NaN counting as the maximum (torch.argmax's rule).
static int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
  bool nan = false;
#ifdef CONTBATCH_AVX2
  __m256 high[4], unordered = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) high[k] = _mm256_set1_ps(-INFINITY);
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * k);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      high[k] = _mm256_max_ps(high[k], v);
    }
  best = hmax(_mm256_max_ps(_mm256_max_ps(high[0], high[1]), _mm256_max_ps(high[2], high[3])));
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  if (nan) return std::find_if(x, x + n, [](float v) { return std::isnan(v); }) - x;
  int64_t j = 0;
#ifdef CONTBATCH_AVX2
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (mask != 0) return j + __builtin_ctz(mask);
  }
#endif
  for (; j < n; ++j)
    if (x[j] == best) return j;
  return 0;
}

// logits: [N, V] float32 contiguous. Returns [N] int64, row r's `argmax_row`: torch.argmax(logits, -1).
torch::Tensor row_argmax(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.dtype() == torch::kFloat32 && logits.is_contiguous());
  TORCH_CHECK(logits.size(1) > 0, "argmax of an empty row");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  const float* x = logits.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) index[r] = argmax_row(x + r * cols, cols);
  });
  return out;
}

// How many threads at::parallel_for runs this extension's loops on (1 when it was built without OpenMP).
int64_t parallel_threads() {
  std::vector<int> used(at::get_num_threads() + 1, 0);
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { used[at::get_thread_num()] = 1; });
  return std::count(used.begin(), used.end(), 1);
}

// panel_gemm.cpp
bool has_panel_gemm();
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                           const c10::optional<torch::Tensor>& bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_rows", &write_rows, "store K/V rows at cache slots");
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
  m.def("row_argmax", &row_argmax, "argmax over the last dim (CPU, float32), as torch.argmax");
  m.def("has_panel_gemm", &has_panel_gemm, "whether panel_linear is built (AVX2 + FMA)");
  m.def("panel_linear", &panel_linear, "x @ W.T + bias with W prepacked in 16-column panels (CPU, float32)");
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for uses in this extension");
}
