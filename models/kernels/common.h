// Pieces shared by the specjax CPU kernels (small_matmul.cc, attention.cc): 16-float vectors
// (GCC vector extensions: AVX-512 with -march=native where present) and the task runner that
// splits a call between the calling thread and XLA's intra-op pool.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace specjax_kernels {

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// The vector the hot loops compute in, one register: 16 floats with AVX-512, else 8. GCC
// keeps a 16-float generic vector on the stack where no register holds it (every operation
// goes through memory: on an AVX2 CPU the matmul ran 3-6x slower than XLA's dot), so there
// a 16-float block is two of these, with the same products and sums lane for lane.
typedef float v8 __attribute__((vector_size(32)));
#if defined(__AVX512F__)
using vf = v16;
#else
using vf = v8;
#endif
constexpr int kLanes = sizeof(vf) / sizeof(float);
constexpr int kParts = 16 / kLanes;  // vf vectors per 16-float block
inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// Runs fn(i) for every i < tasks on the caller and up to `helpers` threads of the pool, each
// claiming the next task as it comes (a helper that starts late then costs little), and
// returns once every task is done (the acquire below makes their writes visible). The state
// is shared with the helpers, so one that starts after the return finds no task left and
// never calls fn: fn may refer to the caller's stack.
template <class Fn>
void RunTasks(xla::ffi::ThreadPool& pool, int64_t tasks, int64_t helpers, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    const int64_t tasks;
    Fn fn;
    State(int64_t t, Fn f) : tasks(t), fn(std::move(f)) {}
    void Work() {
      for (;;) {
        const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= tasks) return;
        fn(i);
        done.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  };
  auto state = std::make_shared<State>(tasks, std::move(fn));
  if (helpers > tasks - 1) helpers = tasks - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state]() { state->Work(); });
  state->Work();
  while (state->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
}

}  // namespace specjax_kernels
