// A linear layer over a weight prepacked in column panels, for the row counts of decode and prefill steps, computed
// in float32. The panels hold float32, or bfloat16 for bfloat16 models. Without bfloat16 arithmetic, each bfloat16
// line is widened to float32 as it is loaded (exact), the products are float32 FMAs (exact for bfloat16 operands),
// and the result is rounded to bfloat16 once, at the end, as a float32-accumulating bfloat16 GEMM does: each task
// rounds its own outputs from a float32 scratch that stays in cache, instead of the product writing float32 [M, N]
// and converting it in a pass of its own (on a Zen 4, the 30 layers' bfloat16 products 1.09x at 32 rows, 1.03x at
// 128, the same at 512). The register tiles are in panel_tiles.h.
//
// The weight [N, K] is stored as panels [P, K, 16] (P = ceil(N / 16), the last one zero-padded): panel p holds
// output features 16p .. 16p + 15, one 64-byte line per k. A task is one panel over a block of rows that stays in L2
// (about 384 KiB of input a block), the block in tiles of up to 6 rows whose 6 x 16 outputs live in 12 AVX2 registers
// while k runs: per k, two loads of the panel line and 6 broadcasts feed 12 FMAs. A block's rows are spread evenly
// over its tiles (31 rows: 6 + 5 x 5, not 5 x 6 + 1, whose one-row tile has too few FMA chains to hide their
// latency: 0.92x the time for 31 rows on a Zen 3). Threads take tasks as they come free (`GuidedTasks`): on a shared
// host, a thread the host stalls no longer keeps the other waiting for its half. Every output is
// one FMA chain over k in order, so a row's result does not depend on the other rows of the batch. For a few rows, k
// runs in chunks (partial sums kept in the output between them, the same chain), each chunk through all the tiles
// while it sits in L1. While a panel's tiles run, the next panel's lines are prefetched, a share before each tile
// (the first tile of a panel would otherwise wait on memory: the weights do not stay in cache from one step to the
// next).
//
// Where the build has AVX-512, a task takes two float32 panels at once (32 columns): the tiles' 6 x 32 outputs live in
// 12 AVX-512 registers, fed per k by one load of each panel's line and 6 broadcasts (`wide_tile`). The FMA chains are
// the same, so the results are too. On a Zen 5 this is 1.1-1.3x oneDNN's prepacked product at 16-128 rows and as
// fast at 512 (docs/performance.md, "a twenty-first session").
//
// Where the build has AVX512-BF16, bfloat16 panels hold k in pairs instead ([P, ceil(K / 2), 32]: line j holds
// columns 0-15 at k = 2j and 2j + 1, interleaved by column, a zero k past an odd K), and a tile multiplies them by
// the input's bfloat16 pairs with `vdpbf16ps`: per lane, one instruction adds both products of a pair to a float32
// accumulator (denormals flushed), twice the arithmetic of a float32 FMA. A task takes three panels (48 columns), a
// tile up to 8 rows (24 accumulators). Each output is still one float32 chain over the k pairs in order, so a row's
// result depends on neither the batch nor the thread count. On a Zen 5, 1.15x oneDNN's bfloat16 product at 128
// rows, 1.3x at 16-64, as fast at 512 (docs/performance.md, "a twenty-second session").
//
// bfloat16 blocks of 64 columns ([B, K / 2, 128], `amx_gemm.cpp`) go to the AMX product instead.
//
// Without AVX2 + FMA nothing is built here (`has_panel_gemm()` is false) and the caller keeps its other path.
#include "tensor.h"
#include <ATen/Parallel.h>

// amx_gemm.cpp: bfloat16 blocks [B, K / 2, 128] go there.
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const c10::optional<at::Tensor>& bias);
constexpr int64_t kAmxBlock = 64;

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

// Where a task prefetches its next panels' lines (36-72 KiB, read after the current ones): cache level 1 or 2, for the
// process. Into L1 they can evict the chunk the current tiles reuse (on a Zen 4's AVX-512 build L2 was 1.25-1.45x at
// 8-32 rows); which is faster depends on the CPU, measured once a machine (engine/kernel_tuning.py).
static std::atomic<int64_t> panel_prefetch_level{1};

void set_panel_prefetch(int64_t level) {
  TORCH_CHECK(level == 1 || level == 2, "panel prefetch: cache level 1 or 2, got ", level);
  panel_prefetch_level.store(level, std::memory_order_relaxed);
}
int64_t panel_prefetch() { return panel_prefetch_level.load(std::memory_order_relaxed); }

#if defined(__AVX2__) && defined(__FMA__)
#include "guided_tasks.h"
#include "panel_tiles.h"
#include "simd.h"

namespace {

constexpr int64_t kBlockFloats = 96 * 1024;
// Up to kChunkMaxRows rows, k runs in chunks of kChunk lines (6 KiB of panel), each chunk through every tile of the
// block: the chunk stays in L1 across the tiles, where a whole panel (K lines) would be read from L2 for each tile.
// At 32 rows and weights streamed from memory this is about 1.2x; from about 128 rows it no longer helps.
constexpr int64_t kChunkMaxRows = 96;
constexpr int64_t kChunk = 96;

// The kinds of panels: X the input's element type as the tiles read it, P the panels', kLine the P elements of a
// panel's line (one k step), kRows a tile's rows at most, kWidth the panels a task takes at once, kChunkRows the row
// counts up to which k runs in chunks, tile(rows, width) the tile function.
struct FloatPanels {
  using X = float;
  using P = float;
#if defined(__AVX512F__)
  static constexpr int64_t kWidth = 2;
#else
  static constexpr int64_t kWidth = 1;
#endif
  static constexpr int64_t kLine = kPanel, kRows = kTileRows, kChunkRows = kChunkMaxRows;
  static TileFn<X, P> tile(int64_t rows, int64_t width) {
#if defined(__AVX512F__)
    if (width == 2) return kWideTiles[rows];
#endif
    return kTiles<float>[rows];
  }
};

struct WidenedPanels {
  using X = float;
  using P = uint16_t;
  static constexpr int64_t kWidth = 1, kLine = kPanel, kRows = kTileRows, kChunkRows = kChunkMaxRows;
  static TileFn<X, P> tile(int64_t rows, int64_t) { return kTiles<uint16_t>[rows]; }
};

#if defined(__AVX512BF16__)
struct PairPanels {
  using X = int32_t;
  using P = uint16_t;
  static constexpr int64_t kWidth = kPairWidth, kLine = 2 * kPanel, kRows = kPairRows, kChunkRows = kChunkMaxRows;
  static TileFn<X, P> tile(int64_t rows, int64_t width) { return kPairTiles[width - 1][rows]; }
};
#endif

// The tiles of rows [m0, m1) over `width` panels from `panel` (`ncols` real columns), into y (row m0's outputs, rows
// `ldy` floats apart), k steps in chunks of `chunk`; the `next_lines` lines from `next` (the thread's next panels) are
// prefetched a share before each tile, with `__builtin_prefetch`'s locality Loc (3: L1, 2: L2).
template <typename Kind, int Loc>
void panel_tiles(const typename Kind::X* xs, const typename Kind::P* panel, int64_t width, const float* bias,
                 float* y, int64_t ldy, int64_t ncols, int64_t m0, int64_t m1, int64_t steps_k, int64_t chunk,
                 const typename Kind::P* next, int64_t next_lines) {
  using P = typename Kind::P;
  constexpr int64_t kLinesPerCacheLine = std::max<int64_t>(1, 64 / (Kind::kLine * static_cast<int64_t>(sizeof(P))));
  const int64_t chunks = std::max<int64_t>(1, (steps_k + chunk - 1) / chunk);
  const int64_t tiles = (m1 - m0 + Kind::kRows - 1) / Kind::kRows, steps = tiles * chunks;
  const int64_t lines_per_step = (next_lines + steps - 1) / steps;
  int64_t step = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = c * chunk, kc = std::min(chunk, steps_k - k0);
    for (int64_t t = 0, m = m0; t < tiles; ++t, ++step) {
      const int64_t rows = (m1 - m0) / tiles + (t < (m1 - m0) % tiles);
      const int64_t stop = std::min(next_lines, (step + 1) * lines_per_step);
      for (int64_t line = step * lines_per_step; line < stop; ++line) {
        if (line % kLinesPerCacheLine == 0) __builtin_prefetch(next + line * Kind::kLine, 0, Loc);
      }
      Kind::tile(rows, width)(xs + m * steps_k + k0, steps_k, kc, panel + k0 * Kind::kLine, steps_k * Kind::kLine,
                              y + (m - m0) * ldy, ldy, ncols, bias, c > 0, c + 1 == chunks);
      m += rows;
    }
  }
}

// Rows [0, rows) of `ncols` float32 values (`lds` apart) rounded to bfloat16 into `dst` (rows `ldd` apart), to nearest
// even as `Tensor.to(torch.bfloat16)` rounds (`bf16_bits8`; a NaN stays a NaN).
void store_bf16_rows(const float* src, int64_t lds, c10::BFloat16* dst, int64_t ldd, int64_t rows, int64_t ncols) {
  for (int64_t r = 0; r < rows; ++r) {
    int64_t j = 0;
    for (; j + 8 <= ncols; j += 8) store8(dst + r * ldd + j, _mm256_loadu_ps(src + r * lds + j));
    for (; j < ncols; ++j) dst[r * ldd + j] = c10::BFloat16(src[r * lds + j]);
  }
}

// y [M, N] = xs [M, steps_k] (k steps of the kind's X) @ W.T + bias, W in panels `ps` [P, steps_k, kLine], into `ys`
// (float32), or with `ys16` into bfloat16 rows there: each task's outputs are then computed into a float32 scratch of
// the thread's, which stays in cache, and rounded once (no float32 [M, N] is written). A task is `Kind::kWidth`
// panels (fewer at the end) over one block of rows, the blocks in order; threads take ranges of tasks as they come
// free (`GuidedTasks`), each claiming its next range as it starts the last task of the current one, so that it can
// prefetch the next task's lines. Which thread computes a task does not change its outputs.
template <typename Kind, int Loc>
void panel_product(const typename Kind::X* xs, const typename Kind::P* ps, const float* bias_data, float* ys,
                   c10::BFloat16* ys16, int64_t M, int64_t steps_k, int64_t N, int64_t P_count) {
  constexpr int64_t kRows = Kind::kRows, kTaskCols = Kind::kWidth * kPanel;
  const int64_t block = std::max<int64_t>(kRows, kBlockFloats / std::max<int64_t>(steps_k, 1) / kRows * kRows);
  const int64_t chunk = std::max<int64_t>(1, M <= Kind::kChunkRows ? std::min(kChunk, steps_k) : steps_k);
  const size_t scratch_floats = ys16 ? static_cast<size_t>(std::min(M, block) * kTaskCols) : 0;
  const int64_t groups = (P_count + Kind::kWidth - 1) / Kind::kWidth, tasks = (M + block - 1) / block * groups;
  const auto first_panel = [&](int64_t task) { return task % groups * Kind::kWidth; };
  const auto panels_of = [&](int64_t task) { return std::min(Kind::kWidth, P_count - first_panel(task)); };
  GuidedTasks claims(tasks, at::get_num_threads());
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> scratch;
    if (scratch.size() < scratch_floats) scratch.resize(scratch_floats);
    for (auto range = claims.claim(); range.first < range.second;) {
      auto following_range = range;
      for (int64_t task = range.first; task < range.second; ++task) {
        if (task + 1 == range.second) following_range = claims.claim();
        const int64_t ahead = task + 1 < range.second ? task + 1 : following_range.first;
        const int64_t m0 = task / groups * block, m1 = std::min(M, m0 + block);
        const int64_t p = first_panel(task), width = panels_of(task), col = p * kPanel;
        const int64_t ncols = std::min(width * kPanel, N - col), following = ahead < tasks ? panels_of(ahead) : 0;
        const typename Kind::P* following_panel = ps + (ahead < tasks ? first_panel(ahead) : 0) * steps_k * Kind::kLine;
        panel_tiles<Kind, Loc>(xs, ps + p * steps_k * Kind::kLine, width, bias_data ? bias_data + col : nullptr,
                               ys16 ? scratch.data() : ys + m0 * N + col, ys16 ? kTaskCols : N, ncols, m0, m1, steps_k,
                               chunk, following_panel, following * steps_k);
        if (ys16) store_bf16_rows(scratch.data(), kTaskCols, ys16 + m0 * N + col, N, m1 - m0, ncols);
      }
      range = following_range;
    }
  });
}

// `panel_product` with the process's prefetch level (`set_panel_prefetch`).
template <typename Kind>
void panel_product_at_level(const typename Kind::X* xs, const typename Kind::P* ps, const float* bias_data, float* ys,
                            c10::BFloat16* ys16, int64_t M, int64_t steps_k, int64_t N, int64_t P_count) {
  if (panel_prefetch() == 2) panel_product<Kind, 2>(xs, ps, bias_data, ys, ys16, M, steps_k, N, P_count);
  else panel_product<Kind, 3>(xs, ps, bias_data, ys, ys16, M, steps_k, N, P_count);
}

}  // namespace

bool has_panel_gemm() { return true; }

bool has_wide_panels() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool has_pair_panels() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] contiguous, float32 or bfloat16; panels contiguous, of x's dtype: [P, K, 16] (bfloat16 lines interleaved,
// see load_line), or for bfloat16 where `has_pair_panels()` [P, ceil(K / 2), 32] in k pairs; 16 (P - 1) < N <= 16 P;
// bias [N] or None. Returns x @ W.T + bias, [M, N], in x's dtype (computed in float32).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const c10::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  if (dtype == at::kBFloat16 && panels.dim() == 3 && panels.size(2) == 2 * kAmxBlock) {
    return amx_linear(x, panels, N, bias);
  }
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (dtype == at::kFloat || dtype == at::kBFloat16),
              "x: [M, K] contiguous float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1);
  const bool pairs = panels.dim() == 3 && panels.size(2) == 2 * kPanel;
  TORCH_CHECK(!pairs || (has_pair_panels() && dtype == at::kBFloat16),
              "panels in k pairs ([P, ceil(K / 2), 32]) need bfloat16 and a build with AVX512-BF16");
  const int64_t steps_k = pairs ? (K + 1) / 2 : K;
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == dtype && panels.is_contiguous() &&
                  panels.size(1) == steps_k && (pairs || panels.size(2) == kPanel),
              "panels: [P, K, 16] (bfloat16 also [P, ceil(K / 2), 32]) contiguous, of x's dtype and with the K of x");
  const int64_t P = panels.size(0);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "N does not match the panels");
  at::Tensor bias32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == dtype, "bias: [N] of x's dtype");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* bias_data = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  auto y = at::empty({M, N}, x.options());
  if (dtype == at::kFloat) {
    panel_product_at_level<FloatPanels>(x.data_ptr<float>(), panels.data_ptr<float>(), bias_data, y.data_ptr<float>(),
                                        nullptr, M, K, N, P);
    return y;
  }
  auto* ys16 = y.data_ptr<at::BFloat16>();
  const auto* bf16 = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
#if defined(__AVX512BF16__)
  if (pairs) {
    const at::Tensor even = K % 2 ? at::constant_pad_nd(x, {0, 1}) : x;
    const auto* xs = reinterpret_cast<const int32_t*>(even.data_ptr<at::BFloat16>());
    panel_product_at_level<PairPanels>(xs, bf16, bias_data, nullptr, ys16, M, steps_k, N, P);
    return y;
  }
#endif
  const at::Tensor x32 = x.to(at::kFloat);
  panel_product_at_level<WidenedPanels>(x32.data_ptr<float>(), bf16, bias_data, nullptr, ys16, M, K, N, P);
  return y;
}

#else

bool has_panel_gemm() { return false; }

bool has_wide_panels() { return false; }

bool has_pair_panels() { return false; }

at::Tensor panel_linear(const at::Tensor&, const at::Tensor&, int64_t,
                        const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "panel_linear needs AVX2 and FMA");
}

#endif
