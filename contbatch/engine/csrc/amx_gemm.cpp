// A bfloat16 linear layer on AMX tiles, for the row counts of decode steps and prompt chunks: oneDNN's batch-reduce
// GEMM micro-kernel, as torch exposes it (`at::native::cpublas::brgemm`), over a weight prepacked once in 64-column
// blocks. oneDNN's own prepacked product (`mkldnn::_linear_pointwise`) spends about 20 us a call before its kernel
// runs (descriptors, its primitive cache, a scratchpad); this calls the micro-kernel straight, from cached kernels.
// On an AMX Xeon (2 threads), in us: 128 x 576 x 576 36-41 against 51-67, 128 x 1536 x 576 85-108 against 107-154,
// the 30 layers' seven products with cold weights at 16 rows 10-12 ms against 14-19 (docs/performance.md, "a sixtieth
// session"). At 2,048 rows oneDNN's own blocking wins, so the caller takes `F.linear` above 512.
// `amx_silu_mul` runs an MLP's gate and up products task by task and writes `silu_mul`'s result from both scratches.
//
// The weight [N, K] (K even) is stored as blocks [B, K / 2, 128] (B = ceil(N / 64), zero-padded): block b holds
// output features 64b .. 64b + 63 in AMX's pair layout, line j holding each feature's k = 2j and 2j + 1 side by side.
// A task is one block times up to 32 rows: the micro-kernel writes the 32 x 64 float32 products to a scratch that
// stays in L1, and the task adds the bias and rounds each to bfloat16 (to nearest even, as torch does). Rows are taken
// 256 at a time, their tasks block-major, so a thread's consecutive tasks share a block while it is in cache. Each
// output is the micro-kernel's float32 sum over k, which depends on neither the other rows nor the thread count.
#include "tensor.h"
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "elementwise.h"

bool has_amx_panels();

namespace {

constexpr int64_t kBlock = 64;
constexpr int64_t kTaskRows = 32;
constexpr int64_t kRowsAtOnce = 256;

// rows x 64 float32 products at c (row stride 64) plus bias (or none), rounded to bfloat16 into out's columns
// [n0, n0 + width) (row stride N).
void round_rows(const float* c, const float* bias, int64_t rows, int64_t width, at::BFloat16* out, int64_t N) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 lanes = width - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - j)) - 1);
      __m512 v = _mm512_loadu_ps(c + r * kBlock + j);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(lanes, bias + j));
      _mm256_mask_storeu_epi16(out + r * N + j, lanes, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// F.silu(gate) * up from rows x 64 float32 products of each (row stride 64) into out's columns [n0, n0 + width)
// (width a multiple of 16, row stride N): both rounded to bfloat16 first, then as `silu_mul` computes it.
void silu_mul_rows(const float* gate, const float* up, int64_t rows, int64_t width, at::BFloat16* out, int64_t N) {
  const Lanes::V one = Lanes::set1(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < width; j += Lanes::kWidth) {
      const Lanes::V g = round_to<at::BFloat16>(Lanes::load(gate + r * kBlock + j));
      const Lanes::V silu = Lanes::div(g, Lanes::add(one, Lanes::exp(Lanes::neg(g))));
      const Lanes::V u = round_to<at::BFloat16>(Lanes::load(up + r * kBlock + j));
      Lanes::store(out + r * N + j, Lanes::mul(round_to<at::BFloat16>(silu), u));
    }
  }
}

void check_blocks(const at::Tensor& x, const at::Tensor& blocks, int64_t N) {
  TORCH_CHECK(has_amx_panels(), "AMX blocks need a CPU whose bfloat16 micro-kernel oneDNN runs on AMX");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x: [M, K] contiguous bfloat16");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 2 == 0 && blocks.dim() == 3 && blocks.is_contiguous() && blocks.scalar_type() == at::kBFloat16 &&
                  blocks.size(1) == K / 2 && blocks.size(2) == 2 * kBlock,
              "blocks: [B, K / 2, 128] contiguous bfloat16, with the (even) K of x");
  TORCH_CHECK(N > (blocks.size(0) - 1) * kBlock && N <= blocks.size(0) * kBlock, "N does not match the blocks");
}

// For every task (a block b times up to kTaskRows rows from `row`), rows taken kRowsAtOnce at a time, block-major:
// task(b, row, rows) on the threads.
template <typename Task>
void for_tasks(int64_t M, int64_t B, const Task& task) {
  for (int64_t r0 = 0; r0 < M; r0 += kRowsAtOnce) {
    const int64_t tasks_a_block = (std::min(kRowsAtOnce, M - r0) + kTaskRows - 1) / kTaskRows;
    at::parallel_for(0, B * tasks_a_block, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t row = r0 + t % tasks_a_block * kTaskRows;
        task(t / tasks_a_block, row, std::min(kTaskRows, M - row));
      }
      at::native::cpublas::brgemm_release();
    });
  }
}

}  // namespace

bool has_amx_panels() { return at::native::cpublas::could_pack(at::kBFloat16); }

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const c10::optional<at::Tensor>& bias) {
  check_blocks(x, blocks, N);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kBFloat16, "bias: [N] bfloat16");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* bias_data = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  auto y = at::empty({M, N}, x.options());
  const auto* a = x.data_ptr<at::BFloat16>();
  const auto* w = blocks.data_ptr<at::BFloat16>();
  auto* out = y.data_ptr<at::BFloat16>();
  for_tasks(M, blocks.size(0), [&](int64_t b, int64_t row, int64_t rows) {
    alignas(64) float scratch[kTaskRows * kBlock];
    at::native::cpublas::brgemm(rows, kBlock, K, K, kBlock, kBlock, false, a + row * K, w + b * K * kBlock, scratch);
    round_rows(scratch, bias_data == nullptr ? nullptr : bias_data + b * kBlock, rows, std::min(kBlock, N - b * kBlock),
               out + row * N + b * kBlock, N);
  });
  return y;
}

at::Tensor amx_silu_mul(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& up, int64_t N) {
  check_blocks(x, gate, N);
  check_blocks(x, up, N);
  TORCH_CHECK(N % Lanes::kWidth == 0, "amx_silu_mul: N must be a multiple of ", Lanes::kWidth, ", got ", N);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  const auto* a = x.data_ptr<at::BFloat16>();
  const auto *g = gate.data_ptr<at::BFloat16>(), *u = up.data_ptr<at::BFloat16>();
  auto* out = y.data_ptr<at::BFloat16>();
  for_tasks(M, gate.size(0), [&](int64_t b, int64_t row, int64_t rows) {
    alignas(64) float gates[kTaskRows * kBlock];
    alignas(64) float ups[kTaskRows * kBlock];
    at::native::cpublas::brgemm(rows, kBlock, K, K, kBlock, kBlock, false, a + row * K, g + b * K * kBlock, gates);
    at::native::cpublas::brgemm(rows, kBlock, K, K, kBlock, kBlock, false, a + row * K, u + b * K * kBlock, ups);
    silu_mul_rows(gates, ups, rows, std::min(kBlock, N - b * kBlock), out + row * N + b * kBlock, N);
  });
  return y;
}

#else

bool has_amx_panels() { return false; }

at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "amx_linear needs a build with AVX512-BF16");
}

at::Tensor amx_silu_mul(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "amx_silu_mul needs a build with AVX512-BF16");
}

#endif
