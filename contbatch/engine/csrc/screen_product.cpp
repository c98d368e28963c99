// The head screen's int8 product on AVX2 without VNNI: s_j (q_j . c) for hidden rows of codes c in [-63, 63], stored
// as unsigned bytes u = c + z, and the head's int8 rows q_j. oneDNN's product reaches about 40% of the machine's int8
// rate there (a Zen 3: 137 of 326 GOP/s); this one is written for the shape of a decode step (a hundred rows against a
// vocabulary of tens of thousands).
//
// The rows q_j are packed in panels of 16 (`screen_pack`): [ceil(V / 16), ceil(K / 4), 64] bytes, line k4 holding
// columns 0-7 then 8-15, each as its 4 bytes at k = 4 k4 .. 4 k4 + 3 (zeros past V and past K). Per line, a tile
// broadcasts 4 bytes of each of its rows, multiplies them by both halves of the line with `vpmaddubsw` (u8 x s8 pairs
// summed in int16: at most 2 x 127 x 127 = 32,258 with 7-bit codes, so never saturated) and widens the pairs with
// `vpmaddwd` into int32 sums of 4, added to the accumulators. Every sum is exact: |u . q_j| <= K x 127 x 127, below
// 2^31 for K < 133,000. The result is u . q_j - z sum_k q_jk = c . q_j, an integer of magnitude at most
// K x 63 x 127 (exact in float32 for K < 2,097, else rounded once there), times s_j in float32, as oneDNN's.
#include "tensor.h"
#include <ATen/Parallel.h>

#include "guided_tasks.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>

namespace {

constexpr int64_t kCols = 16;
constexpr int64_t kQuad = 4;
constexpr int64_t kLineBytes = kCols * kQuad;
constexpr int kRows = 4;

// One R x 16 tile: rows u (R rows `ldu` bytes apart, padded to whole quads), `quads` lines of `panel`; writes
// (acc - z * sums) * scales for the tile's `ncols` real columns into out (rows `ldo` floats apart).
template <int R>
void screen_tile(const uint8_t* u, int64_t ldu, int64_t quads, const int8_t* panel, const int32_t* sums,
                 const float* scales, int32_t z, float* out, int64_t ldo, int64_t ncols) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (int64_t k4 = 0; k4 < quads; ++k4) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k4 * kLineBytes));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + k4 * kLineBytes + 32));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, u + r * ldu + k4 * kQuad, sizeof(quad));
      const __m256i a = _mm256_set1_epi32(quad);
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a, w0), ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a, w1), ones));
    }
  }
  const __m256i zero_point = _mm256_set1_epi32(z);
  const __m256i shift0 = _mm256_mullo_epi32(zero_point, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums)));
  const __m256i shift1 = _mm256_mullo_epi32(zero_point, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + 8)));
  const __m256 s0 = _mm256_loadu_ps(scales), s1 = _mm256_loadu_ps(scales + 8);
  alignas(32) float row[kCols];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(row, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][0], shift0)), s0));
    _mm256_store_ps(row + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][1], shift1)), s1));
    std::memcpy(out + r * ldo, row, ncols * sizeof(float));
  }
}

using ScreenTile = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, const int32_t*, const float*, int32_t,
                            float*, int64_t, int64_t);
constexpr ScreenTile kScreenTiles[kRows + 1] = {nullptr, screen_tile<1>, screen_tile<2>, screen_tile<3>,
                                                screen_tile<4>};

}  // namespace

bool has_screen_product() { return true; }

// int8 [V, K] -> (panels [ceil(V / 16), ceil(K / 4), 64] int8, sums [16 ceil(V / 16)] int32: each row's sum).
std::tuple<at::Tensor, at::Tensor> screen_pack(const at::Tensor& int8) {
  TORCH_CHECK(int8.dim() == 2 && int8.scalar_type() == at::kChar, "int8: [V, K] int8");
  const int64_t V = int8.size(0), K = int8.size(1), P = (V + kCols - 1) / kCols, quads = (K + kQuad - 1) / kQuad;
  const at::Tensor padded = at::constant_pad_nd(int8.contiguous(), {0, quads * kQuad - K, 0, P * kCols - V});
  const at::Tensor panels = padded.view({P, 2, 8, quads, kQuad}).permute({0, 3, 1, 2, 4}).contiguous()
                                   .view({P, quads, kLineBytes});
  return {panels, padded.sum(1, false, at::kInt)};
}

// codes [R, K] uint8 (c + z, c in [-63, 63]); panels and sums from `screen_pack`; scales [V] float32; out [R, V]
// float32 contiguous, overwritten with s_j (c . q_j).
void screen_product(const at::Tensor& codes, const at::Tensor& panels, const at::Tensor& sums,
                    const at::Tensor& scales, int64_t z, at::Tensor& out) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes: [R, K] contiguous uint8");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kChar && panels.is_contiguous() &&
                  panels.size(2) == kLineBytes, "panels: from screen_pack");
  const int64_t R = codes.size(0), K = codes.size(1), P = panels.size(0), quads = panels.size(1);
  const int64_t V = scales.size(0);
  TORCH_CHECK(quads == (K + kQuad - 1) / kQuad && V > (P - 1) * kCols && V <= P * kCols, "panels do not match");
  TORCH_CHECK(sums.scalar_type() == at::kInt && sums.numel() == P * kCols && scales.is_contiguous() &&
                  scales.scalar_type() == at::kFloat, "sums or scales do not match the panels");
  TORCH_CHECK(out.sizes() == at::IntArrayRef({R, V}) && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "out: [R, V] contiguous float32");
  const at::Tensor u = at::constant_pad_nd(codes, {0, quads * kQuad - K}, static_cast<double>(z)).contiguous();
  const at::Tensor scale16 = at::constant_pad_nd(scales, {0, P * kCols - V});
  const uint8_t* us = u.data_ptr<uint8_t>();
  const int8_t* ps = panels.data_ptr<int8_t>();
  const int32_t* sum = sums.data_ptr<int32_t>();
  const float* scale = scale16.data_ptr<float>();
  float* ys = out.data_ptr<float>();
  const int64_t ldu = quads * kQuad;
  GuidedTasks claims(P, at::get_num_threads());
  at::parallel_for(0, std::min<int64_t>(P, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    for (auto range = claims.claim(); range.first < range.second; range = claims.claim()) {
      for (int64_t p = range.first; p < range.second; ++p) {
        const int64_t ncols = std::min(kCols, V - p * kCols);
        for (int64_t r = 0; r < R; r += kRows) {
          kScreenTiles[std::min<int64_t>(kRows, R - r)](us + r * ldu, ldu, quads, ps + p * quads * kLineBytes,
                                                        sum + p * kCols, scale + p * kCols, static_cast<int32_t>(z),
                                                        ys + r * V + p * kCols, V, ncols);
        }
      }
    }
  });
}

#else

bool has_screen_product() { return false; }

std::tuple<at::Tensor, at::Tensor> screen_pack(const at::Tensor&) {
  TORCH_CHECK(false, "screen_pack needs AVX2");
}

void screen_product(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                    at::Tensor&) {
  TORCH_CHECK(false, "screen_product needs AVX2");
}

#endif
