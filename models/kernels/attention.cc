// specjax cached attention for XLA CPU (float32): one custom call per layer instead of a
// loop of ~15 small XLA ops per chunk of slots, whose dispatch cost (not FLOPs) dominated
// attention in a decode / verification step (4.5 ms of a 25 ms 1-token step at 256 cached
// slots).
//
//   q [B, T, Nkv, G, H], k_all / v_all [L, B, Nkv, S, H], layer int32[], positions int32[B, T]
//   -> o [B, T, Nkv, G, H];  query (b, t, kv, g) sees slots s <= positions[b, t] (s < S).
//
// Same law as models/llama.py:cached_attention (softmax in float32, max-subtracted), in a
// fixed order per query row that does not depend on the batch or on the other rows. Work
// is split over (b, kv head) pairs between the caller and XLA's intra-op pool when large.
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

// exp for a vector of floats: Cody-Waite range reduction + degree-6 polynomial (~2 ulp),
// inputs <= 0 here (max-subtracted scores); underflows cleanly to 0 below -87.
inline v16 vexp(v16 x) {
  const v16 lo = v16{} - 87.3f;
  x = x < lo ? lo : x;
  const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  v16 r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  v16 y = p * scale;
  return x <= lo ? v16{} : y;
}

struct Dims {
  int64_t B, T, Nkv, G, H, L, S;
};

// One (b, kv head): every query row (t, g) against slots 0..min(pos, S-1).
void Head(const Dims& d, const float* q, const float* k, const float* v, const int32_t* pos_b,
          int64_t b, int64_t h, float* o, std::vector<float>& sc) {
  const int64_t TG = d.T * d.G, H = d.H;
  int64_t last = 0;  // highest visible slot over the rows
  for (int64_t t = 0; t < d.T; ++t) {
    int64_t p = pos_b[t] < d.S - 1 ? pos_b[t] : d.S - 1;
    if (p > last) last = p;
  }
  const int64_t n = last + 1;
  const int64_t n16 = (n + 15) / 16 * 16;
  sc.resize(TG * n16);
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  // scores[r, s] = q_r . k_s * scale, 16 slots at a time: the block of K is transposed
  // into kt[H][16] so that each query row accumulates 16 slots in one vector.
  thread_local std::vector<float> kt_buf;
  kt_buf.resize(H * 16);
  float* kt = kt_buf.data();
  for (int64_t s0 = 0; s0 < n; s0 += 16) {
    const int64_t nb = n - s0 < 16 ? n - s0 : 16;
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t i = 0; i < H; ++i) kt[i * 16 + j] = j < nb ? k[(s0 + j) * H + i] : 0.f;
    for (int64_t r = 0; r < TG; ++r) {
      const int64_t t = r / d.G, g = r % d.G;
      const float* qr = q + (((b * d.T + t) * d.Nkv + h) * d.G + g) * H;
      v16 acc = v16{};
      for (int64_t i = 0; i < H; ++i) {
        v16 kv;
        std::memcpy(&kv, kt + i * 16, sizeof(kv));
        acc += qr[i] * kv;
      }
      acc *= scale;
      std::memcpy(sc.data() + r * n16 + s0, &acc, sizeof(acc));
    }
  }
  // per row: softmax over its visible slots, then the weighted sum of V
  for (int64_t r = 0; r < TG; ++r) {
    const int64_t t = r / d.G, g = r % d.G;
    const int64_t vis = (pos_b[t] < d.S - 1 ? pos_b[t] : d.S - 1) + 1;  // slots 0..vis-1
    float* sr = sc.data() + r * n16;
    float m = sr[0];
    for (int64_t s = 1; s < vis; ++s) m = sr[s] > m ? sr[s] : m;
    for (int64_t s = vis; s < n16; ++s) sr[s] = -INFINITY;  // masked (and padding)
    v16 lsum = v16{};
    for (int64_t s = 0; s < n16; s += 16) {
      v16 x;
      std::memcpy(&x, sr + s, sizeof(x));
      x = vexp(x - m);
      std::memcpy(sr + s, &x, sizeof(x));
      lsum += x;
    }
    float l = 0.f;
    for (int j = 0; j < 16; ++j) l += lsum[j];
    float* orow = o + (((b * d.T + t) * d.Nkv + h) * d.G + g) * H;
    const float inv = 1.0f / l;
    if (H % 16 == 0 && H <= 256) {
      v16 acc[16];
      const int64_t hv = H / 16;
      for (int64_t c = 0; c < hv; ++c) acc[c] = v16{};
      for (int64_t s = 0; s < vis; ++s) {
        const float w = sr[s];
        const float* vs = v + s * H;
        for (int64_t c = 0; c < hv; ++c) {
          v16 x;
          std::memcpy(&x, vs + 16 * c, sizeof(x));
          acc[c] += w * x;
        }
      }
      for (int64_t c = 0; c < hv; ++c) {
        const v16 y = acc[c] * inv;
        std::memcpy(orow + 16 * c, &y, sizeof(y));
      }
    } else {
      for (int64_t i = 0; i < H; ++i) orow[i] = 0.f;
      for (int64_t s = 0; s < vis; ++s) {
        const float w = sr[s];
        const float* vs = v + s * H;
        for (int64_t i = 0; i < H; ++i) orow[i] += w * vs[i];
      }
      for (int64_t i = 0; i < H; ++i) orow[i] *= inv;
    }
  }
}

struct Job {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  Dims d{};
  const float *q = nullptr, *k = nullptr, *v = nullptr;
  const int32_t* pos = nullptr;
  int64_t layer = 0;
  float* o = nullptr;
  void Work() {
    thread_local std::vector<float> sc;
    const int64_t tasks = d.B * d.Nkv;
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= tasks) return;
      const int64_t b = i / d.Nkv, h = i % d.Nkv;
      const int64_t off = (((layer * d.B + b) * d.Nkv + h) * d.S) * d.H;
      Head(d, q, k + off, v + off, pos + b * d.T, b, h, o, sc);
      done.fetch_add(1, std::memory_order_acq_rel);
    }
  }
};

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_all,
                         ffi::Buffer<ffi::F32> v_all, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> positions, ffi::ResultBuffer<ffi::F32> o) {
  const auto qd = q.dimensions(), kd = k_all.dimensions(), pd = positions.dimensions();
  const auto vd = v_all.dimensions();
  bool ok = qd.size() == 5 && kd.size() == 5 && vd.size() == 5 && pd.size() == 2 && kd[1] == qd[0] &&
            kd[2] == qd[2] && kd[4] == qd[4] && pd[0] == qd[0] && pd[1] == qd[1];
  for (int i = 0; ok && i < 5; ++i) ok = vd[i] == kd[i];
  if (!ok) return ffi::Error::InvalidArgument("specjax attention: inconsistent shapes");
  auto job = std::make_shared<Job>();
  job->d = Dims{qd[0], qd[1], qd[2], qd[3], qd[4], kd[0], kd[3]};
  job->layer = layer.typed_data()[0];
  if (job->layer < 0 || job->layer >= job->d.L)
    return ffi::Error::InvalidArgument("specjax attention: layer index out of range");
  const int32_t* pos = positions.typed_data();
  int64_t maxpos = 0;
  for (int64_t i = 0; i < qd[0] * qd[1]; ++i) {
    if (pos[i] < 0) return ffi::Error::InvalidArgument("specjax attention: negative position");
    maxpos = pos[i] > maxpos ? pos[i] : maxpos;
  }
  job->q = q.typed_data();
  job->k = k_all.typed_data();
  job->v = v_all.typed_data();
  job->pos = pos;
  job->o = o->typed_data();
  const int64_t tasks = job->d.B * job->d.Nkv;
  // rough FLOPs; below ~20 MFLOP one thread beats waking the pool (measured: waking it for
  // a 5-token step at 256 slots made the step times bimodal)
  const double work = 4.0 * tasks * qd[1] * qd[3] * qd[4] * (maxpos + 1.0);
  int64_t helpers = work > 2e7 ? pool.num_threads() : 0;
  if (helpers > tasks - 1) helpers = tasks - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([job]() { job->Work(); });
  job->Work();
  while (job->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
