// Work shared among a parallel region's threads as they come free (the kernels' own "guided" schedule).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

// Tasks [0, total) handed out in ranges of consecutive tasks, a share of the remaining ones each: large ranges first
// (a thread streams its panels in order, as the hardware prefetcher likes), single tasks at the end, so that a
// thread slowed down (by the host, on a shared machine) leaves the other threads its remaining work, not its half.
class GuidedTasks {
 public:
  GuidedTasks(int64_t total, int64_t threads) : total_(total), parts_(2 * std::max<int64_t>(1, threads)) {}
  // The next range [first, second) of tasks, empty once they are all taken.
  std::pair<int64_t, int64_t> claim() {
    int64_t first = next_.load(std::memory_order_relaxed);
    while (first < total_) {
      const int64_t last = first + std::max<int64_t>(1, (total_ - first) / parts_);
      if (next_.compare_exchange_weak(first, last, std::memory_order_relaxed)) return {first, last};
    }
    return {total_, total_};
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t total_, parts_;
};
