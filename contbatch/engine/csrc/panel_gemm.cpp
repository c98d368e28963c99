// A linear layer over a weight prepacked in column panels, for the row counts of decode and prefill steps, computed
// in float32. The panels hold float32, or bfloat16 for bfloat16 models. Without bfloat16 arithmetic, each bfloat16
// line is widened to float32 as it is loaded (exact), the products are float32 FMAs (exact for bfloat16 operands),
// and the result is rounded to bfloat16 once, at the end, as a float32-accumulating bfloat16 GEMM does.
//
// The weight [N, K] is stored as panels [P, K, 16] (P = ceil(N / 16), the last one zero-padded): panel p holds
// output features 16p .. 16p + 15, one 64-byte line per k. A task is one panel; the rows are taken in blocks that
// stay in L2 (about 384 KiB of input a block), and each block in tiles of up to 6 rows whose 6 x 16 outputs live in
// 12 AVX2 registers while k runs: per k, two loads of the panel line and 6 broadcasts feed 12 FMAs. Every output is
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
// Without AVX2 + FMA nothing is built here (`has_panel_gemm()` is false) and the caller keeps its other path.
#include "tensor.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <utility>

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
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kTileRows = 6;
constexpr int64_t kBlockFloats = 96 * 1024;
// Up to kChunkMaxRows rows, k runs in chunks of kChunk lines (6 KiB of panel), each chunk through every tile of the
// block: the chunk stays in L1 across the tiles, where a whole panel (K lines) would be read from L2 for each tile.
// At 32 rows and weights streamed from memory this is about 1.2x; from about 128 rows it no longer helps.
constexpr int64_t kChunkMaxRows = 96;
constexpr int64_t kChunk = 96;

// Runs BODY(r) for the tile's rows r < R; BODY names row r's accumulators c<r>0 and c<r>1. Named accumulators, not
// arrays: GCC keeps arrays of __m256 in memory and stores them at every k.
#define CONTBATCH_TILE_ROWS(BODY) \
  BODY(0)                         \
  if constexpr (R > 1) { BODY(1) } \
  if constexpr (R > 2) { BODY(2) } \
  if constexpr (R > 3) { BODY(3) } \
  if constexpr (R > 4) { BODY(4) } \
  if constexpr (R > 5) { BODY(5) }

// Line k of a panel as two float32 vectors (its 16 columns).
inline void load_line(const float* line, __m256& b0, __m256& b1) {
  b0 = _mm256_loadu_ps(line);
  b1 = _mm256_loadu_ps(line + 8);
}

// A bfloat16 line is stored interleaved (columns 0, 8, 1, 9, ..., 7, 15: `pack_panels`), so that the low halves of its
// eight 32-bit words are columns 0-7 and the high halves columns 8-15: one shift and one mask widen it.
inline void load_line(const uint16_t* line, __m256& b0, __m256& b1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  b0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  b1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// One R x 16 tile over k in [0, kc): x points at the tile's first row at its first k (rows ldx apart), panel at the
// panel's line for that k, y at the tile's outputs (rows ldy apart, ncols of the 16 columns real). With `resume` the
// accumulators start from the partial sums in y, else from zero; with `finish` the bias is added, else y receives
// partial sums for a later chunk of k. Either way each output stays one FMA chain over k in order.
template <int R, typename P>
inline void tile(const float* x, int64_t ldx, int64_t kc, const P* panel, int64_t, float* y, int64_t ldy,
                 int64_t ncols, const float* bias, bool resume, bool finish) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(ncols)), lane);
  const __m256i high = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(ncols) - 8), lane);
  const __m256 zero = _mm256_setzero_ps();
  const float *x0 = x, *x1 = x + std::min(1, R - 1) * ldx, *x2 = x + std::min(2, R - 1) * ldx;
  const float *x3 = x + std::min(3, R - 1) * ldx, *x4 = x + std::min(4, R - 1) * ldx, *x5 = x + (R - 1) * ldx;
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define CONTBATCH_START(r)                                                   \
  c##r##0 = resume ? _mm256_maskload_ps(y + r * ldy, low) : zero;            \
  c##r##1 = resume ? _mm256_maskload_ps(y + r * ldy + 8, high) : zero;
  CONTBATCH_TILE_ROWS(CONTBATCH_START)
  for (int64_t k = 0; k < kc; ++k) {
    __m256 b0, b1;
    load_line(panel + k * kPanel, b0, b1);
#define CONTBATCH_FMA(r)                                \
  {                                                     \
    const __m256 a = _mm256_broadcast_ss(x##r + k);     \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);          \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);          \
  }
    CONTBATCH_TILE_ROWS(CONTBATCH_FMA)
  }
  const __m256 d0 = finish && bias ? _mm256_maskload_ps(bias, low) : zero;
  const __m256 d1 = finish && bias ? _mm256_maskload_ps(bias + 8, high) : zero;
#define CONTBATCH_STORE(r)                                                  \
  _mm256_maskstore_ps(y + r * ldy, low, _mm256_add_ps(c##r##0, d0));        \
  _mm256_maskstore_ps(y + r * ldy + 8, high, _mm256_add_ps(c##r##1, d1));
  CONTBATCH_TILE_ROWS(CONTBATCH_STORE)
#undef CONTBATCH_START
#undef CONTBATCH_FMA
#undef CONTBATCH_STORE
}

// A tile function: (x, ldx, k steps, panel, stride between the task's panels, y, ldy, ncols, bias, resume, finish).
template <typename X, typename P>
using TileFn = void (*)(const X*, int64_t, int64_t, const P*, int64_t, float*, int64_t, int64_t, const float*, bool,
                        bool);
template <typename P>
constexpr TileFn<float, P> kTiles[kTileRows + 1] = {nullptr, tile<1, P>, tile<2, P>, tile<3, P>, tile<4, P>,
                                                    tile<5, P>, tile<6, P>};

#if defined(__AVX512F__)
// One R x 32 tile over two adjacent float32 panels (the second `stride` floats after the first; ncols of the 32
// columns real, at least 17): per k, one 16-lane load of each panel's line and R broadcasts feed 2R FMAs into 2R
// AVX-512 registers. Otherwise as `tile`: each output one FMA chain over k in order, whatever the tile.
template <int R>
inline void wide_tile(const float* x, int64_t ldx, int64_t kc, const float* panel, int64_t stride, float* y,
                      int64_t ldy, int64_t ncols, const float* bias, bool resume, bool finish) {
  const __mmask16 high = static_cast<__mmask16>((1u << (ncols - kPanel)) - 1u);
  const float *x0 = x, *x1 = x + std::min(1, R - 1) * ldx, *x2 = x + std::min(2, R - 1) * ldx;
  const float *x3 = x + std::min(3, R - 1) * ldx, *x4 = x + std::min(4, R - 1) * ldx, *x5 = x + (R - 1) * ldx;
  __m512 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
#define CONTBATCH_START(r)                                                      \
  c##r##0 = resume ? _mm512_loadu_ps(y + r * ldy) : _mm512_setzero_ps();        \
  c##r##1 = resume ? _mm512_maskz_loadu_ps(high, y + r * ldy + kPanel) : _mm512_setzero_ps();
  CONTBATCH_TILE_ROWS(CONTBATCH_START)
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(panel + k * kPanel), b1 = _mm512_loadu_ps(panel + stride + k * kPanel);
#define CONTBATCH_FMA(r)                              \
  {                                                   \
    const __m512 a = _mm512_set1_ps(x##r[k]);         \
    c##r##0 = _mm512_fmadd_ps(a, b0, c##r##0);        \
    c##r##1 = _mm512_fmadd_ps(a, b1, c##r##1);        \
  }
    CONTBATCH_TILE_ROWS(CONTBATCH_FMA)
  }
  const __m512 d0 = finish && bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 d1 = finish && bias ? _mm512_maskz_loadu_ps(high, bias + kPanel) : _mm512_setzero_ps();
#define CONTBATCH_STORE(r)                                                         \
  _mm512_storeu_ps(y + r * ldy, _mm512_add_ps(c##r##0, d0));                       \
  _mm512_mask_storeu_ps(y + r * ldy + kPanel, high, _mm512_add_ps(c##r##1, d1));
  CONTBATCH_TILE_ROWS(CONTBATCH_STORE)
#undef CONTBATCH_START
#undef CONTBATCH_FMA
#undef CONTBATCH_STORE
}

constexpr TileFn<float, float> kWideTiles[kTileRows + 1] = {nullptr, wide_tile<1>, wide_tile<2>, wide_tile<3>,
                                                             wide_tile<4>, wide_tile<5>, wide_tile<6>};
#endif

#if defined(__AVX512BF16__)
constexpr int64_t kPairRows = 8;
constexpr int64_t kPairWidth = 3;

// One R x 16W tile over W adjacent pair panels (`stride` elements apart; ncols of the 16W columns real): per k pair,
// one load of each panel's line and R broadcasts of the rows' pairs feed RW `vdpbf16ps` into RW accumulators (the
// loops are unrolled, so the arrays live in registers).
template <int R, int W>
inline void pair_tile(const int32_t* x, int64_t ldx, int64_t kc, const uint16_t* panel, int64_t stride, float* y,
                      int64_t ldy, int64_t ncols, const float* bias, bool resume, bool finish) {
  __mmask16 mask[W];
  __m512 c[R][W];
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) {
    mask[w] = static_cast<__mmask16>((1u << std::clamp<int64_t>(ncols - w * kPanel, 0, kPanel)) - 1u);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      c[r][w] = resume ? _mm512_maskz_loadu_ps(mask[w], y + r * ldy + w * kPanel) : _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    __m512bh b[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) b[w] = (__m512bh)_mm512_loadu_si512(panel + w * stride + k * 2 * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) c[r][w] = _mm512_dpbf16_ps(c[r][w], a, b[w]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const __m512 d = finish && bias ? _mm512_maskz_loadu_ps(mask[w], bias + w * kPanel) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(y + r * ldy + w * kPanel, mask[w], _mm512_add_ps(c[r][w], d));
    }
  }
}

template <int W, int... Rs>
constexpr std::array<TileFn<int32_t, uint16_t>, kPairRows + 1> pair_tiles(std::integer_sequence<int, Rs...>) {
  return {nullptr, pair_tile<Rs + 1, W>...};
}
constexpr std::array<TileFn<int32_t, uint16_t>, kPairRows + 1> kPairTiles[kPairWidth] = {
    pair_tiles<1>(std::make_integer_sequence<int, kPairRows>{}),
    pair_tiles<2>(std::make_integer_sequence<int, kPairRows>{}),
    pair_tiles<3>(std::make_integer_sequence<int, kPairRows>{})};
#endif

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

// The tiles of rows [m0, m1) over `width` panels from `panel` (their first column `col`), k steps in chunks of
// `chunk`; the `next_lines` lines from `next` (the thread's next panels) are prefetched a share before each tile, with
// `__builtin_prefetch`'s locality Loc (3: L1, 2: L2).
template <typename Kind, int Loc>
void panel_tiles(const typename Kind::X* xs, const typename Kind::P* panel, int64_t width, const float* bias,
                 float* ys, int64_t m0, int64_t m1, int64_t steps_k, int64_t N, int64_t col, int64_t chunk,
                 const typename Kind::P* next, int64_t next_lines) {
  using P = typename Kind::P;
  constexpr int64_t kLinesPerCacheLine = std::max<int64_t>(1, 64 / (Kind::kLine * static_cast<int64_t>(sizeof(P))));
  const int64_t chunks = std::max<int64_t>(1, (steps_k + chunk - 1) / chunk);
  const int64_t steps = (m1 - m0 + Kind::kRows - 1) / Kind::kRows * chunks;
  const int64_t lines_per_step = (next_lines + steps - 1) / steps, ncols = std::min(width * kPanel, N - col);
  int64_t step = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t k0 = c * chunk, kc = std::min(chunk, steps_k - k0);
    for (int64_t m = m0; m < m1; m += Kind::kRows, ++step) {
      const int64_t stop = std::min(next_lines, (step + 1) * lines_per_step);
      for (int64_t line = step * lines_per_step; line < stop; ++line) {
        if (line % kLinesPerCacheLine == 0) __builtin_prefetch(next + line * Kind::kLine, 0, Loc);
      }
      Kind::tile(std::min(Kind::kRows, m1 - m), width)(xs + m * steps_k + k0, steps_k, kc, panel + k0 * Kind::kLine,
                                                         steps_k * Kind::kLine, ys + m * N + col, N, ncols, bias,
                                                         c > 0, c + 1 == chunks);
    }
  }
}

// y [M, N] = xs [M, steps_k] (k steps of the kind's X) @ W.T + bias, W in panels `ps` [P, steps_k, kLine]. A thread
// takes its panels `Kind::kWidth` at a time (fewer where its range ends).
template <typename Kind, int Loc>
void panel_product(const typename Kind::X* xs, const typename Kind::P* ps, const float* bias_data, float* ys,
                   int64_t M, int64_t steps_k, int64_t N, int64_t P_count) {
  constexpr int64_t kRows = Kind::kRows;
  const int64_t block = std::max<int64_t>(kRows, kBlockFloats / std::max<int64_t>(steps_k, 1) / kRows * kRows);
  const int64_t chunk = std::max<int64_t>(1, M <= Kind::kChunkRows ? std::min(kChunk, steps_k) : steps_k);
  at::parallel_for(0, P_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      for (int64_t p = begin; p < end;) {
        const int64_t width = std::min(Kind::kWidth, end - p), following = std::min(Kind::kWidth, end - p - width);
        const typename Kind::P* panel = ps + p * steps_k * Kind::kLine;
        panel_tiles<Kind, Loc>(xs, panel, width, bias_data ? bias_data + p * kPanel : nullptr, ys, m0,
                               std::min(M, m0 + block), steps_k, N, p * kPanel, chunk,
                               panel + width * steps_k * Kind::kLine, following * steps_k);
        p += width;
      }
    }
  });
}

// `panel_product` with the process's prefetch level (`set_panel_prefetch`).
template <typename Kind>
void panel_product_at_level(const typename Kind::X* xs, const typename Kind::P* ps, const float* bias_data, float* ys,
                            int64_t M, int64_t steps_k, int64_t N, int64_t P_count) {
  if (panel_prefetch() == 2) panel_product<Kind, 2>(xs, ps, bias_data, ys, M, steps_k, N, P_count);
  else panel_product<Kind, 3>(xs, ps, bias_data, ys, M, steps_k, N, P_count);
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
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const float* bias_data = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  if (dtype == at::kFloat) {
    panel_product_at_level<FloatPanels>(x.data_ptr<float>(), panels.data_ptr<float>(), bias_data, ys, M, K, N, P);
    return y;
  }
  const auto* bf16 = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
#if defined(__AVX512BF16__)
  if (pairs) {
    const at::Tensor even = K % 2 ? at::constant_pad_nd(x, {0, 1}) : x;
    const auto* xs = reinterpret_cast<const int32_t*>(even.data_ptr<at::BFloat16>());
    panel_product_at_level<PairPanels>(xs, bf16, bias_data, ys, M, steps_k, N, P);
    return y.to(dtype);
  }
#endif
  const at::Tensor x32 = x.to(at::kFloat);
  panel_product_at_level<WidenedPanels>(x32.data_ptr<float>(), bf16, bias_data, ys, M, K, N, P);
  return y.to(dtype);
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
