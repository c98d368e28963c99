// The rotary position embedding of Llama-style attention (transformers' `apply_rotary_pos_emb` with `rotate_half`) in
// one pass over the query and key rows, for contbatch's eager CPU forwards (fused_modules.py). Per element:
//   y[i] = x[i] * cos[i] + r[i] * sin[i],  r = (-x[half:], x[:half]) for i below and above half the head's width,
// each product and the sum rounded to the dtype as PyTorch's ops round them (float32: two products, then the sum,
// never fused into an FMA; bfloat16: each rounded to bfloat16), so the result equals the module's own bit for bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "elementwise.h"

namespace {

// The value as computed, kept out of a following add: GCC would contract `a * b + c * d` into an FMA, which rounds
// once where PyTorch's ops round twice.
template <typename V>
inline V opaque(V v) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (sizeof(V) == 64) {
    asm("" : "+v"(v));
  } else {
    asm("" : "+x"(v));
  }
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  volatile V kept = v;
  v = kept;
#endif
  return v;
}

// y[j] = T(T(x[j] * c[j]) + T(sign * r[j] * s[j])) for j in [0, n): one half of a head's row.
template <typename T>
inline void rotate_half_row(const T* x, const T* r, const T* c, const T* s, T* y, int64_t n, bool negate) {
  int64_t j = 0;
#ifdef CONTBATCH_AVX2
  for (; j + Lanes::kWidth <= n; j += Lanes::kWidth) {
    const Lanes::V rotated = negate ? Lanes::neg(Lanes::load(r + j)) : Lanes::load(r + j);
    const Lanes::V first = opaque(round_to<T>(Lanes::mul(Lanes::load(x + j), Lanes::load(c + j))));
    const Lanes::V second = opaque(round_to<T>(Lanes::mul(rotated, Lanes::load(s + j))));
    Lanes::store(y + j, Lanes::add(first, second));
  }
#endif
  for (; j < n; ++j) {
    const float rotated = negate ? -widen(r[j]) : widen(r[j]);
    const float first = opaque(round_to<T>(widen(x[j]) * widen(c[j])));
    const float second = opaque(round_to<T>(rotated * widen(s[j])));
    y[j] = static_cast<T>(first + second);
  }
}

// rows [tokens, heads * dim] -> y, token t's heads rotated by cos/sin row t ([tokens, dim]).
template <typename T>
void rope_rows(const T* x, const T* cos, const T* sin, T* y, int64_t tokens, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens * heads, std::max<int64_t>(1, kGrainElements / dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * dim;
      const T* c = cos + row / heads * dim;
      const T* s = sin + row / heads * dim;
      T* yr = y + row * dim;
      rotate_half_row(xr, xr + half, c, s, yr, half, true);
      rotate_half_row(xr + half, xr, c + half, s + half, yr + half, half, false);
    }
  });
}

at::Tensor rope_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t dim = cos.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == cos.scalar_type() &&
                  x.size(0) == cos.size(0) && x.size(1) % dim == 0,
              "rows: [tokens, heads * head_dim] contiguous, of cos's dtype and tokens");
  auto y = at::empty_like(x);
  if (x.numel() == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>(), x.size(0),
              x.size(1) / dim, dim);
  } else {
    rope_rows(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
              y.data_ptr<at::BFloat16>(), x.size(0), x.size(1) / dim, dim);
  }
  return y;
}

}  // namespace

// query [tokens, heads * head_dim] and key [tokens, kv_heads * head_dim] rows (the projections' outputs), cos and sin
// [tokens, head_dim], all contiguous and of one dtype, float32 or bfloat16, head_dim even. Returns the rotated query
// and key rows, as transformers' `apply_rotary_pos_emb` computes them (see the file's comment).
std::vector<at::Tensor> rope(const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos,
                             const at::Tensor& sin) {
  const auto dtype = cos.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rope: float32 or bfloat16");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                  sin.scalar_type() == dtype && cos.size(1) % 2 == 0,
              "cos and sin: [tokens, head_dim] contiguous, of one dtype, head_dim even");
  return {rope_one(query, cos, sin), rope_one(key, cos, sin)};
}
