// Work sharing for the kernels whose pieces of work are independent (a feature of a linear,
// a sequence of attention, a row of a norm): which thread computes a piece changes nothing in
// its result.
//
// Two ways to run: each kernel call opens its own parallel region over ATen's threads (the
// default), or a team (run_team) keeps the threads inside one region across many kernels, as
// llama_layers does for a whole decode step: the kernels then share their work among the
// team's members and end at a barrier instead of a fork and a join. At one sequence the step
// calls ~270 kernels of 5-100 us; a region each cost ~10 us of them.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FREETOKEN_PAUSE() _mm_pause()
#else
#define FREETOKEN_PAUSE() std::this_thread::yield()
#endif

namespace freetoken {

// Shared state of a team: a barrier and the counters of its guided loops.
struct Team {
  std::atomic<int> arrived{0};
  std::atomic<int> generation{0};
  std::atomic<bool> failed{false};
  std::atomic<int64_t> next[2] = {0, 0};
  std::mutex error_lock;
  std::exception_ptr error;
};

// This thread's place in the team it runs in.
struct Member {
  Team* team;
  int id, size;
  int64_t loops;  // guided loops this member has entered (the same count on every member)
};

inline thread_local Member* current_member = nullptr;

// Raised in the members that wait at a barrier when another member's kernel threw; run_team
// rethrows the first member's own exception instead.
struct TeamAborted : std::exception {
  const char* what() const noexcept override { return "freetoken: team aborted"; }
};

// Spins of ~50 cycles before a waiting member yields its core (to the HTTP process, or to the
// member it waits for when the threads outnumber the free cores).
constexpr int kBarrierSpins = 4000;

inline void barrier(Member& m) {
  Team& t = *m.team;
  const int gen = t.generation.load(std::memory_order_acquire);
  if (t.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == m.size) {
    t.arrived.store(0, std::memory_order_relaxed);
    t.generation.store(gen + 1, std::memory_order_release);
    return;
  }
  for (int spins = 0; t.generation.load(std::memory_order_acquire) == gen;) {
    if (t.failed.load(std::memory_order_relaxed)) throw TeamAborted();
    if (++spins < kBarrierSpins) {
      FREETOKEN_PAUSE();
    } else {
      std::this_thread::yield();
    }
  }
}

inline bool in_team() { return current_member != nullptr; }

// The threads that share a kernel's work: a team's size inside a team, where every member
// must take the same decisions from it (ATen's thread count is a per-thread setting that the
// members need not share), else ATen's thread count.
inline int64_t work_threads() {
  return current_member != nullptr ? current_member->size : at::get_num_threads();
}

// body() on each of ATen's threads inside one parallel region, as a team: the kernels it
// calls share their work among the members (guided_for, parallel_rows). Every member must
// call the same kernels on the same shapes, and nothing that allocates per member. One
// thread (or already inside a region): body() runs once, without a team.
template <typename F>
void run_team(const F& body) {
#ifdef _OPENMP
  const int threads = at::get_num_threads();
  if (threads <= 1 || in_team() || omp_in_parallel()) {
    body();
    return;
  }
  Team team;
#pragma omp parallel num_threads(threads)
  {
    Member member{&team, omp_get_thread_num(), omp_get_num_threads(), 0};
    current_member = &member;
    try {
      body();
    } catch (const TeamAborted&) {
    } catch (...) {
      std::lock_guard<std::mutex> lock(team.error_lock);
      if (!team.error) team.error = std::current_exception();
      team.failed.store(true, std::memory_order_relaxed);
    }
    current_member = nullptr;
  }
  if (team.error) std::rethrow_exception(team.error);
#else
  body();
#endif
}

// fn(begin, end) over ranges that cover [0, total) once, handed out to ATen's threads from a
// shared counter in shrinking pieces (guided self-scheduling: a piece is the remaining work
// over twice the thread count, at least `min_piece`, rounded up to a multiple of `multiple`).
// A static split makes every step wait for its slowest thread: with two threads on two cores,
// a thread that lost its core for a moment (the HTTP process, an interrupt) or started late
// holds up the other, which spun in the barrier for ~8 % of a 16-row decode step. Here the
// other thread takes over the rest, and the last pieces are small, so both end together.
// In a team, the members share the pieces and meet at a barrier at the end.
template <typename F>
void guided_for(int64_t total, int64_t min_piece, int64_t multiple, const F& fn) {
  auto take_pieces = [&](std::atomic<int64_t>& next, int64_t threads) {
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
  };
  if (Member* m = current_member) {
    // Loop i takes its pieces from counter i % 2; the first member zeroes the other one,
    // which every member left behind at the barrier that ended loop i - 1.
    Team& t = *m->team;
    if (m->id == 0) t.next[(m->loops + 1) & 1].store(0, std::memory_order_relaxed);
    take_pieces(t.next[m->loops & 1], m->size);
    ++m->loops;
    barrier(*m);
    return;
  }
  const int64_t threads = at::get_num_threads();
  if (total <= 0) return;
  if (threads <= 1 || total <= min_piece || at::in_parallel_region()) {
    fn(0, total);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { take_pieces(next, threads); });
}

// fn(begin, end) over [0, rows) for work too small to hand out in pieces (a norm, a rotation,
// a copy per token): at::parallel_for with `grain` rows per task, or, in a team, one equal
// share per member followed by a barrier (one row: the first member does it).
template <typename F>
void parallel_rows(int64_t rows, int64_t grain, const F& fn) {
  if (Member* m = current_member) {
    const int64_t share = (rows + m->size - 1) / m->size;
    const int64_t begin = std::min(rows, m->id * share), end = std::min(rows, begin + share);
    if (begin < end) fn(begin, end);
    barrier(*m);
    return;
  }
  at::parallel_for(0, rows, grain, fn);
}

}  // namespace freetoken
