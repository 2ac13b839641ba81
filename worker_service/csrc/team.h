// The threads of one OpenMP parallel region working through a sequence of phases, with a barrier
// between phases that spins a short while and then sleeps (Linux futex).
//
// Why not OpenMP's own barriers or one region per phase: with OMP_WAIT_POLICY=passive (which
// `radixserve up` sets, since spinning threads starve the router and gateway on shared cores)
// every region start and every barrier puts the waiting thread to sleep and wakes it through the
// kernel, tens of microseconds each on the machines we measured, and a decode step of a 30-layer
// model crosses some 300 of them. Spinning without bound instead (OMP_WAIT_POLICY=active) is fast
// on idle cores and several times slower on busy ones, where a spinning thread holds a core its
// descheduled partner needs. Here a waiting thread spins at most kSpinNs, far longer than the
// threads of a step normally arrive apart (their shares of a product are equal) and far shorter
// than a scheduler's time slice: a partner that lost its core costs at most that much spinning
// before this thread sleeps. (A spin that shrank after each wait that outlasted it collapsed
// through the stack, where the router and gateway take a core now and then, into a sleep and a
// wake-up at every barrier: a step took twice as long.)
#pragma once

#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>

namespace radix_team {

constexpr int64_t kSpinNs = 50000;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Barrier {
 public:
  // Every thread of the team calls wait() the same number of times with the same `size`.
  void wait(int size) {
    const uint32_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0)
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr,
                0);
      return;
    }
    const int64_t deadline = now_ns() + kSpinNs;
    for (int i = 1;; ++i) {
      if (generation_.load(std::memory_order_acquire) != generation) return;
      _mm_pause();
      if (i % 32 == 0 && now_ns() > deadline) break;
    }
    while (generation_.load(std::memory_order_acquire) == generation) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (generation_.load(std::memory_order_seq_cst) == generation)
        syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAIT_PRIVATE, generation, nullptr,
                nullptr, 0);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

 private:
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> generation_{0};
  std::atomic<int> sleepers_{0};
};

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");

// One thread's view of the team: its index, the team's size and the shared barrier.
struct Team {
  int index, size;
  Barrier* barrier;
  void sync() const {
    if (size > 1) barrier->wait(size);
  }
  // This thread's share [begin, end) of `count` items split in contiguous blocks, as OpenMP's
  // schedule(static) splits a loop.
  void share(int64_t count, int64_t* begin, int64_t* end) const {
    const int64_t base = count / size, extra = count % size;
    *begin = index * base + std::min<int64_t>(index, extra);
    *end = *begin + base + (index < extra ? 1 : 0);
  }
};

}  // namespace radix_team
