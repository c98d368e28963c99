// contbatch's CPU kernels besides decode attention (decode_attention.cpp) and the panel product (panel_gemm.cpp):
// writing a layer's new K/V rows into the paged cache, and greedy argmax over float32 logits; and the module that
// exposes all of them.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"

// cache: [H, S, D] contiguous; rows: [H, T, D] with a contiguous last dim; slots: [T] int64, each in [0, S).
// Stores row (h, t) at cache (h, slots[t]) (of rows sharing a slot, one is kept). A decode step writes one row per
// request into lines no core has touched since the previous step: ordinary stores first read each line from memory.
// Where rows are whole 32-byte vectors the rows are written with non-temporal stores instead, which skip that read.
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
torch::Tensor row_argmax(const torch::Tensor& logits) {
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(logits.dim() == 2 && (dtype == torch::kFloat32 || dtype == torch::kBFloat16) && logits.is_contiguous(),
              "logits: [N, V] contiguous float32 or bfloat16");
  TORCH_CHECK(logits.size(1) > 0, "argmax of an empty row");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  if (dtype == torch::kFloat32) {
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

// decode_attention.cpp
torch::Tensor paged_decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache,
                                     const torch::Tensor& value_cache, const torch::Tensor& slots,
                                     const torch::Tensor& lengths, const torch::Tensor& first, double scale,
                                     double softcap, int64_t queries_per_request,
                                     const c10::optional<torch::Tensor>& row_requests,
                                     const c10::optional<torch::Tensor>& sinks);

// panel_gemm.cpp
bool has_panel_gemm();
bool has_wide_panels();
bool has_pair_panels();
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                           const c10::optional<torch::Tensor>& bias);

// fused_ops.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);

// head_screen.cpp
std::vector<torch::Tensor> screen_quantize(const torch::Tensor& hidden, int64_t levels);
std::vector<torch::Tensor> screen_codes(const torch::Tensor& weight);
torch::Tensor screen_tokens(const torch::Tensor& scaled, const torch::Tensor& stats, const torch::Tensor& a,
                            const torch::Tensor& c, const torch::Tensor& hidden, const torch::Tensor& weight);
bool has_vnni();

// screen_product.cpp
bool has_screen_product();
std::tuple<torch::Tensor, torch::Tensor> screen_pack(const torch::Tensor& int8);
void screen_product(const torch::Tensor& codes, const torch::Tensor& panels, const torch::Tensor& sums,
                    const torch::Tensor& scales, int64_t z, torch::Tensor& out);

// rope.cpp
std::vector<torch::Tensor> rope(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& cos,
                                const torch::Tensor& sin);

// draw_rows.cpp
std::vector<torch::Tensor> draw_rows(const torch::Tensor& scores, const torch::Tensor& uniforms);
bool has_draw_rows();

// The compute kernels run without the GIL (they touch no Python object): other Python threads (a server's event
// loop, a trainer beside the engine thread) run while a kernel does, instead of waiting for its end.
const auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_rows", &write_rows, kNoGil, "store K/V rows at cache slots");
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, kNoGil, "paged attention of query rows (CPU)",
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slots"), py::arg("lengths"),
        py::arg("first"), py::arg("scale"), py::arg("softcap"), py::arg("queries_per_request"),
        py::arg("row_requests") = py::none(), py::arg("sinks") = py::none());
  m.def("row_argmax", &row_argmax, kNoGil, "argmax over the last dim (CPU, float32 or bfloat16), as torch.argmax");
  m.def("has_panel_gemm", &has_panel_gemm, "whether panel_linear is built (AVX2 + FMA)");
  m.def("has_wide_panels", &has_wide_panels, "whether panel_linear takes float32 panels two at a time (AVX-512)");
  m.def("has_pair_panels", &has_pair_panels, "whether panel_linear takes bfloat16 panels in k pairs (AVX512-BF16)");
  m.def("panel_linear", &panel_linear, kNoGil, "x @ W.T + bias with W prepacked in 16-column panels (CPU, float32)");
  m.def("rms_norm", &rms_norm, kNoGil, "LlamaRMSNorm's forward over [M, n] rows (CPU, float32 or bfloat16)");
  m.def("silu_mul", &silu_mul, kNoGil, "F.silu(gate) * up (CPU, float32 or bfloat16)");
  m.def("rope", &rope, kNoGil, "apply_rotary_pos_emb over query and key rows (CPU, float32 or bfloat16)");
  m.def("screen_quantize", &screen_quantize, kNoGil,
        "hidden rows as integer codes in [-levels, levels] + levels + 1, with their scale and error norms",
        py::arg("hidden"), py::arg("levels"));
  m.def("screen_codes", &screen_codes, kNoGil, "the head screen's int8 head rows, scales and bound coefficients");
  m.def("screen_tokens", &screen_tokens, kNoGil, "greedy tokens of the output head through the int8 screen");
  m.def("has_vnni", &has_vnni, "whether the build targets a CPU with VNNI");
  m.def("has_screen_product", &has_screen_product, "whether screen_product is built (AVX2)");
  m.def("screen_pack", &screen_pack, kNoGil, "the head screen's int8 rows in panels for screen_product");
  m.def("screen_product", &screen_product, kNoGil, "s_j (c . q_j) for 7-bit hidden codes, into out (AVX2)");
  m.def("draw_rows", &draw_rows, kNoGil, "one token per row drawn from softmax over the whole row, and its logsumexp");
  m.def("has_draw_rows", &has_draw_rows, "whether draw_rows is built (AVX2)");
  m.def("parallel_threads", &parallel_threads, "threads at::parallel_for uses in this extension");
}
