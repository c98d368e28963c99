// The head screen's float32 logits (head_screen.cpp): W_j.h for one token j and one hidden row h, in one fixed order
// (two chains of S's lanes, then a scalar tail), and the logits of every row's candidates, grouped by token so that
// a head row several rows need is read from memory once and multiplied with up to four hidden rows at once. Each
// logit is summed in the same order either way, so its value does not depend on the rows beside it.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

constexpr int kLogitRows = 4;

#ifdef CONTBATCH_AVX2
// W_j.h for R hidden rows h[0..R): each row's own two chains of lanes, its fold and its scalar tail, as for one row.
template <typename S, int R, typename W>
static void vector_logits(const W* w, const float* const* h, int64_t k, float* out) {
  typename S::V a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = S::zero();
  int64_t i = 0;
  for (; i + 2 * S::kWidth <= k; i += 2 * S::kWidth) {
    const typename S::V w0 = S::load(w + i), w1 = S::load(w + i + S::kWidth);
    for (int r = 0; r < R; ++r) {
      a0[r] = S::fma(w0, S::load(h[r] + i), a0[r]);
      a1[r] = S::fma(w1, S::load(h[r] + i + S::kWidth), a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = hsum(S::fold(S::add(a0[r], a1[r])));
    for (int64_t t = i; t < k; ++t) sum += static_cast<float>(w[t]) * h[r][t];
    out[r] = sum;
  }
}
#endif

// W_j.h for `n` (1 to kLogitRows) hidden rows h[0..n), into out[0..n); W float32 or bfloat16.
template <typename W>
static void logits(const W* w, const float* const* h, int n, int64_t k, float* out) {
#if defined(CONTBATCH_AVX2)
#if defined(CONTBATCH_AVX512)
  using S = Lanes16;
#else
  using S = Lanes8;
#endif
  switch (n) {
    case 4: return vector_logits<S, 4>(w, h, k, out);
    case 3: return vector_logits<S, 3>(w, h, k, out);
    case 2: return vector_logits<S, 2>(w, h, k, out);
    default: return vector_logits<S, 1>(w, h, k, out);
  }
#else
  for (int r = 0; r < n; ++r) {
    float sum = 0.f;
    for (int64_t i = 0; i < k; ++i) sum += static_cast<float>(w[i]) * h[r][i];
    out[r] = sum;
  }
#endif
}

template <typename W>
static float logit(const W* w, const float* h, int64_t k) {
  float out;
  logits(w, &h, 1, k, &out);
  return out;
}

// A float32 logit as the head's output holds it: itself, or rounded to bfloat16 (to nearest even, as oneDNN's and
// torch's conversions round).
static inline float as_output(float x, bool bf16) { return bf16 ? static_cast<float>(c10::BFloat16(x)) : x; }

// The candidates of the rows that have several, grouped by token: for token `tokens[i]`, entries `first[i]` to
// `first[i + 1]` of `rows` (the hidden rows that need its logit) and `slots` (where each logit goes: row b's
// candidates take slots `offsets[b]` onwards, in their order). A row's only candidate needs no logit.
struct TokenGroups {
  std::vector<int64_t> offsets, tokens, first, rows, slots;
};

// The groups of one row's candidates (distinct and in token order already): no pass over the vocabulary.
static void group_one_row(const std::vector<int64_t>& found, int64_t row, TokenGroups& g) {
  for (size_t i = 0; i < found.size(); ++i) {
    g.tokens.push_back(found[i]);
    g.first.push_back(static_cast<int64_t>(i));
    g.rows.push_back(row);
    g.slots.push_back(g.offsets[row] + static_cast<int64_t>(i));
  }
  g.first.push_back(static_cast<int64_t>(found.size()));
}

static TokenGroups group_by_token(const std::vector<std::vector<int64_t>>& found, int64_t vocab) {
  TokenGroups g;
  g.offsets.assign(found.size() + 1, 0);
  int64_t several = 0, last = -1;
  for (size_t b = 0; b < found.size(); ++b) {
    g.offsets[b + 1] = g.offsets[b] + static_cast<int64_t>(found[b].size());
    if (found[b].size() > 1) ++several, last = static_cast<int64_t>(b);
  }
  if (several <= 1) {
    if (several == 1) group_one_row(found[last], last, g);
    else g.first.push_back(0);
    return g;
  }
  std::vector<int32_t> start(vocab + 1, 0);
  for (const auto& row : found)
    if (row.size() > 1)
      for (const int64_t j : row) ++start[j + 1];
  for (int64_t j = 0; j < vocab; ++j) {
    if (start[j + 1] > 0) g.tokens.push_back(j);
    start[j + 1] += start[j];
  }
  g.first.reserve(g.tokens.size() + 1);
  for (const int64_t j : g.tokens) g.first.push_back(start[j]);
  g.first.push_back(start[vocab]);
  g.rows.resize(start[vocab]);
  g.slots.resize(start[vocab]);
  for (size_t b = 0; b < found.size(); ++b) {
    for (size_t i = 0; found[b].size() > 1 && i < found[b].size(); ++i) {
      const int64_t entry = start[found[b][i]]++;
      g.rows[entry] = static_cast<int64_t>(b);
      g.slots[entry] = g.offsets[b] + static_cast<int64_t>(i);
    }
  }
  return g;
}

// The float32 logits (for a bfloat16 head, rounded to bfloat16) of the grouped candidates, in slot order (the slots
// of a row's only candidate are left 0). Threads take the tokens `kTokensPerTask` at a time as they come free: a
// token's rows number from one to all of them.
constexpr int64_t kTokensPerTask = 8;

template <typename W>
static std::vector<float> candidate_logits(const TokenGroups& g, const float* hidden, const W* weight, int64_t k) {
  constexpr bool bf16 = std::is_same_v<W, c10::BFloat16>;
  std::vector<float> values(g.offsets.back());
  const int64_t num_tokens = static_cast<int64_t>(g.tokens.size());
  std::atomic<int64_t> next{0};
  const int64_t tasks = (num_tokens + kTokensPerTask - 1) / kTokensPerTask;
  at::parallel_for(0, std::min<int64_t>(tasks, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    const float* h[kLogitRows];
    float out[kLogitRows];
    for (int64_t begin = next.fetch_add(kTokensPerTask); begin < num_tokens;
         begin = next.fetch_add(kTokensPerTask)) {
      const int64_t end = std::min(num_tokens, begin + kTokensPerTask);
      for (int64_t i = begin; i < end; ++i) {
        if (i + 1 < num_tokens) {
          const W* ahead = weight + g.tokens[i + 1] * k;
          for (int64_t d = 0; d < k; d += 64 / sizeof(W)) __builtin_prefetch(ahead + d, 0, 3);
        }
        const W* w = weight + g.tokens[i] * k;
        for (int64_t e = g.first[i]; e < g.first[i + 1]; e += kLogitRows) {
          const int n = static_cast<int>(std::min<int64_t>(kLogitRows, g.first[i + 1] - e));
          for (int r = 0; r < n; ++r) h[r] = hidden + g.rows[e + r] * k;
          logits(w, h, n, k, out);
          for (int r = 0; r < n; ++r) values[g.slots[e + r]] = as_output(out[r], bf16);
        }
      }
    }
  });
  return values;
}
