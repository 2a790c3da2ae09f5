// Work sharing for the kernels whose pieces of work are independent (a feature of a linear,
// a sequence of attention): which thread computes a piece changes nothing in its result.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace freetoken {

// fn(begin, end) over ranges that cover [0, total) once, handed out to ATen's threads from a
// shared counter in shrinking pieces (guided self-scheduling: a piece is the remaining work
// over twice the thread count, at least `min_piece`, rounded up to a multiple of `multiple`).
// A static split makes every step wait for its slowest thread: with two threads on two cores,
// a thread that lost its core for a moment (the HTTP process, an interrupt) or started late
// holds up the other, which spun in the barrier for ~8 % of a 16-row decode step. Here the
// other thread takes over the rest, and the last pieces are small, so both end together.
template <typename F>
void guided_for(int64_t total, int64_t min_piece, int64_t multiple, const F& fn) {
  const int64_t threads = at::get_num_threads();
  if (total <= 0) return;
  if (threads <= 1 || total <= min_piece || at::in_parallel_region()) {
    fn(0, total);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < total) {
      int64_t size = std::max(min_piece, (total - begin) / (2 * threads));
      size = (size + multiple - 1) / multiple * multiple;
      const int64_t end = std::min(total, begin + size);
      if (next.compare_exchange_weak(begin, end, std::memory_order_relaxed)) {
        fn(begin, end);
        begin = next.load(std::memory_order_relaxed);
      }
    }
  });
}

}  // namespace freetoken
