// `contbatch_native::layer_product`: a packed linear layer's product (`packed_weights._product` for a layer that is
// not the output head) as an operator implemented in C++, which a compiled forward calls through the dispatcher
// without entering Python. Each layer's packed copy is registered under the handle of its `PackedLinear`
// (`register_packed`, by `PackedLinear.refresh`): panels ([P, K, 16] or bfloat16 pairs) go through `panel_linear`,
// oneDNN's layout through its `_linear_pointwise`; above `max_rows` rows (> 0) the product is over the plain weight,
// as `packed_weights._unpacked_product` computes it.
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "tensor.h"

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const c10::optional<at::Tensor>& bias);

namespace {

std::shared_mutex registry_mutex;
std::unordered_map<int64_t, at::Tensor> registry;

at::Tensor packed_of(int64_t handle) {
  std::shared_lock lock(registry_mutex);
  const auto found = registry.find(handle);
  TORCH_CHECK(found != registry.end(), "layer_product: no packed weight registered under handle ", handle);
  return found->second;
}

at::Tensor linear_pointwise(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            c10::string_view, c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  return op.call(x.contiguous(), weight, bias, "none", c10::List<c10::optional<at::Scalar>>(), "");
}

at::Tensor layer_product(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                         int64_t handle, int64_t max_rows) {
  const int64_t K = x.size(-1), N = weight.size(0);
  const int64_t rows = K ? x.numel() / K : 0;
  if (max_rows > 0 && rows > max_rows) {
    if (x.scalar_type() == at::kFloat && weight.is_contiguous() && at::hasMKLDNN()) {
      return linear_pointwise(x, weight, bias);
    }
    return at::linear(x, weight, bias);
  }
  const at::Tensor packed = packed_of(handle);
  if (packed.dim() != 3) {
    return linear_pointwise(x, packed, bias);
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  const c10::optional<at::Tensor> contiguous_bias =
      bias.has_value() && bias->defined() ? c10::optional<at::Tensor>(bias->contiguous()) : c10::nullopt;
  return panel_linear(x.reshape({rows, K}).contiguous(), packed, N, contiguous_bias).view(sizes);
}

}  // namespace

void register_packed(int64_t handle, const at::Tensor& packed) {
  std::unique_lock lock(registry_mutex);
  registry[handle] = packed;
}

void forget_packed(int64_t handle) {
  std::unique_lock lock(registry_mutex);
  registry.erase(handle);
}

TORCH_LIBRARY(contbatch_native, m) {
  m.def("layer_product(Tensor x, Tensor weight, Tensor? bias, int handle, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(contbatch_native, CPU, m) { m.impl("layer_product", &layer_product); }
