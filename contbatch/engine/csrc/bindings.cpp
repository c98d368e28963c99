// The module contbatch loads: the Python bindings of every kernel. Only this file includes pybind11 and torch's
// Python headers (about 20 s of compile); the kernels' files include the lighter "tensor.h".
#include <torch/csrc/utils/pybind.h>

#include <tuple>
#include <vector>

#include "tensor.h"

// cpu_kernels.cpp
void write_rows(at::Tensor cache, const at::Tensor& rows, const at::Tensor& slots);
at::Tensor row_argmax(const at::Tensor& logits);
int64_t parallel_threads();

// decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& slots,
                                  const at::Tensor& lengths, const at::Tensor& first, double scale,
                                  double softcap, int64_t queries_per_request,
                                  const c10::optional<at::Tensor>& row_requests,
                                  const c10::optional<at::Tensor>& sinks);
void set_attention_prefetch(int64_t level);
int64_t attention_prefetch();
std::string attention_bfloat16_scores();

// panel_gemm.cpp
bool has_panel_gemm();
void set_panel_prefetch(int64_t level);
int64_t panel_prefetch();
bool has_wide_panels();
bool has_pair_panels();
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const c10::optional<at::Tensor>& bias);

// amx_gemm.cpp
bool has_amx_panels();
at::Tensor amx_silu_mul(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, int64_t N);

// layer_op.cpp
void register_packed(int64_t handle, const at::Tensor& packed);
void forget_packed(int64_t handle);

// fused_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// head_screen.cpp
std::vector<at::Tensor> screen_quantize(const at::Tensor& hidden, int64_t levels);
std::vector<at::Tensor> screen_codes(const at::Tensor& weight);
at::Tensor screen_tokens(const at::Tensor& scaled, const at::Tensor& stats, const at::Tensor& a,
                         const at::Tensor& c, const at::Tensor& hidden, const at::Tensor& weight);
bool has_vnni();

// screen_product.cpp
bool has_screen_product();
std::tuple<at::Tensor, at::Tensor> screen_pack(const at::Tensor& int8);
void screen_product(const at::Tensor& codes, const at::Tensor& panels, const at::Tensor& sums,
                    const at::Tensor& scales, int64_t z, at::Tensor& out);

// rope.cpp
std::vector<at::Tensor> rope(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
                             const at::Tensor& sin);

// draw_rows.cpp
std::vector<at::Tensor> draw_rows(const at::Tensor& scores, const at::Tensor& uniforms);
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
  m.def("set_attention_prefetch", &set_attention_prefetch,
        "the cache level (1 or 2) paged_decode_attention prefetches rows to, for the whole process");
  m.def("attention_prefetch", &attention_prefetch, "the cache level paged_decode_attention prefetches rows to");
  m.def("attention_bfloat16_scores", &attention_bfloat16_scores,
        "how paged_decode_attention computes a bfloat16 cache's scores here: tiles, pairs, lanes or scalar");
  m.def("row_argmax", &row_argmax, kNoGil, "argmax over the last dim (CPU, float32 or bfloat16), as torch.argmax");
  m.def("has_panel_gemm", &has_panel_gemm, "whether panel_linear is built (AVX2 + FMA)");
  m.def("has_wide_panels", &has_wide_panels, "whether panel_linear takes float32 panels two at a time (AVX-512)");
  m.def("has_pair_panels", &has_pair_panels, "whether panel_linear takes bfloat16 panels in k pairs (AVX512-BF16)");
  m.def("set_panel_prefetch", &set_panel_prefetch,
        "the cache level (1 or 2) panel_linear prefetches its next panels to, for the whole process");
  m.def("panel_prefetch", &panel_prefetch, "the cache level panel_linear prefetches its next panels to");
  m.def("has_amx_panels", &has_amx_panels, "whether panel_linear takes bfloat16 blocks for AMX ([B, K / 2, 128])");
  m.def("amx_silu_mul", &amx_silu_mul, kNoGil,
        "F.silu(x @ G.T) * (x @ U.T) in bfloat16, G and U in AMX blocks, each product rounded as a layer's is");
  m.def("panel_linear", &panel_linear, kNoGil, "x @ W.T + bias with W prepacked in 16-column panels (CPU, float32)");
  m.def("register_packed", &register_packed, "a layer's packed weight for the operator contbatch_native::layer_product");
  m.def("forget_packed", &forget_packed, "drop the packed weight registered under a handle");
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
