// contbatch's CPU kernels besides decode attention (decode_attention.cpp) and the panel product (panel_gemm.cpp):
// writing a layer's new K/V rows into the paged cache, and greedy argmax over float32 logits (their bindings:
// bindings.cpp).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"

// cache: [H, S, D] contiguous; rows: [H, T, D] with a contiguous last dim; slots: [T] int64, each in [0, S).
// Stores row (h, t) at cache (h, slots[t]) (of rows sharing a slot, one is kept). A decode step writes one row per
// request into lines no core has touched since the previous step: ordinary stores first read each line from memory.
// Where rows are whole 32-byte vectors the rows are written with non-temporal stores instead, which skip that read.
void write_rows(at::Tensor cache, const at::Tensor& rows, const at::Tensor& slots) {
  TORCH_CHECK(cache.is_contiguous() && rows.dim() == 3 && rows.stride(2) == 1 && cache.dim() == 3);
  TORCH_CHECK(rows.dtype() == cache.dtype() && slots.dtype() == at::kLong && slots.is_contiguous());
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

// The index of the first maximal element of x[0, n), NaN counting as the maximum (torch.argmax's rule); bfloat16
// elements are compared as the float32 values they widen to (exactly).
template <typename T>
static int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
  bool nan = false;
#ifdef CONTBATCH_AVX2
  __m256 high[4], unordered = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) high[k] = _mm256_set1_ps(-INFINITY);
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      const __m256 v = load8(x + i + 8 * k);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      high[k] = _mm256_max_ps(high[k], v);
    }
  best = hmax(_mm256_max_ps(_mm256_max_ps(high[0], high[1]), _mm256_max_ps(high[2], high[3])));
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    nan = nan || std::isnan(v);
    best = std::max(best, v);
  }
  if (nan) return std::find_if(x, x + n, [](T v) { return std::isnan(static_cast<float>(v)); }) - x;
  int64_t j = 0;
#ifdef CONTBATCH_AVX2
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(load8(x + j), target, _CMP_EQ_OQ));
    if (mask != 0) return j + __builtin_ctz(mask);
  }
#endif
  for (; j < n; ++j)
    if (static_cast<float>(x[j]) == best) return j;
  return 0;
}

template <typename T>
static void argmax_rows(const T* x, int64_t rows, int64_t cols, int64_t* index) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) index[r] = argmax_row(x + r * cols, cols);
  });
}

// logits: [N, V] float32 or bfloat16, contiguous. Returns [N] int64, row r's `argmax_row`: torch.argmax(logits, -1).
at::Tensor row_argmax(const at::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) && logits.is_contiguous(),
              "logits: [N, V] contiguous float32 or bfloat16");
  TORCH_CHECK(logits.size(1) > 0, "argmax of an empty row");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  if (dtype == at::kFloat) {
    argmax_rows(logits.data_ptr<float>(), rows, cols, out.data_ptr<int64_t>());
  } else {
    argmax_rows(logits.data_ptr<at::BFloat16>(), rows, cols, out.data_ptr<int64_t>());
  }
  return out;
}

// How many threads at::parallel_for runs this extension's loops on (1 when it was built without OpenMP).
int64_t parallel_threads() {
  std::vector<int> used(at::get_num_threads() + 1, 0);
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { used[at::get_thread_num()] = 1; });
  return std::count(used.begin(), used.end(), 1);
}
