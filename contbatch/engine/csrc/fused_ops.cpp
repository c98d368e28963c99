// Elementwise steps of a decoder layer in one pass each, for contbatch's eager CPU forwards (fused_modules.py): the
// RMS norm of Llama-style models and the SiLU-gated product of their MLPs. Each computes in float32 and rounds to the
// input's dtype where the module's own PyTorch ops do, so the results differ from theirs only by the order of the
// norm's sum of squares and by the exp approximation (about 1 ulp).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "elementwise.h"

namespace {

template <typename T>
float sum_of_squares(const T* x, int64_t n, int64_t& i) {
  float sum = 0.f;
#ifdef CONTBATCH_AVX2
  constexpr int64_t W = Lanes::kWidth;
  Lanes::V acc0 = Lanes::zero(), acc1 = Lanes::zero();
  for (; i + 2 * W <= n; i += 2 * W) {
    const Lanes::V a = Lanes::load(x + i), b = Lanes::load(x + i + W);
    acc0 = Lanes::fma(a, a, acc0);
    acc1 = Lanes::fma(b, b, acc1);
  }
  sum = hsum(Lanes::fold(Lanes::add(acc0, acc1)));
#endif
  for (; i < n; ++i) sum += widen(x[i]) * widen(x[i]);
  return sum;
}

// y = w * T(x * rsqrt(mean(x^2) + eps)), row by row; for bfloat16, the product rounded to bfloat16 as well.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
      int64_t i = 0;
      const float scale = 1.f / std::sqrt(sum_of_squares(xr, n, i) / static_cast<float>(n) + eps);
      i = 0;
#ifdef CONTBATCH_AVX2
      const Lanes::V s = Lanes::set1(scale);
      for (; i + Lanes::kWidth <= n; i += Lanes::kWidth)
        Lanes::store(yr + i, Lanes::mul(Lanes::load(w + i), round_to<T>(Lanes::mul(Lanes::load(xr + i), s))));
#endif
      for (; i < n; ++i) yr[i] = static_cast<T>(widen(w[i]) * round_to<T>(widen(xr[i]) * scale));
    }
  });
}

// y = T(silu(g)) * u, silu(g) = g / (1 + exp(-g)) in float32; for bfloat16 each step rounded to bfloat16.
template <typename T>
void silu_mul_rows(const T* g, const T* u, T* y, int64_t count) {
  at::parallel_for(0, count, kGrainElements, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
#ifdef CONTBATCH_AVX2
    const Lanes::V one = Lanes::set1(1.f);
    for (; i + Lanes::kWidth <= end; i += Lanes::kWidth) {
      const Lanes::V gate = Lanes::load(g + i);
      const Lanes::V silu = Lanes::div(gate, Lanes::add(one, Lanes::exp(Lanes::neg(gate))));
      Lanes::store(y + i, Lanes::mul(round_to<T>(silu), Lanes::load(u + i)));
    }
#endif
    for (; i < end; ++i) {
      const float gate = widen(g[i]);
      y[i] = static_cast<T>(round_to<T>(gate / (1.f + std::exp(-gate))) * widen(u[i]));
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (dtype == at::kFloat || dtype == at::kBFloat16), name,
              ": [M, n] contiguous float32 or bfloat16");
}

}  // namespace

// x [M, n] and weight [n], both float32 or both bfloat16, contiguous. Returns LlamaRMSNorm's forward: weight *
// (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype), in x's dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(), "weight: [n] contiguous, of x's dtype");
  auto y = at::empty_like(x);
  if (x.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
                  static_cast<float>(eps));
  } else {
    rms_norm_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
                  x.size(0), x.size(1), static_cast<float>(eps));
  }
  return y;
}

// gate and up [M, n], both float32 or both bfloat16, contiguous. Returns F.silu(gate) * up in their dtype.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_rows(gate, "gate");
  TORCH_CHECK(up.sizes() == gate.sizes() && up.is_contiguous() && up.scalar_type() == gate.scalar_type(),
              "up: contiguous, of gate's shape and dtype");
  auto y = at::empty_like(gate);
  if (gate.scalar_type() == at::kFloat) {
    silu_mul_rows(gate.data_ptr<float>(), up.data_ptr<float>(), y.data_ptr<float>(), gate.numel());
  } else {
    silu_mul_rows(gate.data_ptr<at::BFloat16>(), up.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(),
                  gate.numel());
  }
  return y;
}
