// specjax cached attention for XLA CPU (float32): one custom call per layer instead of a
// loop of ~15 small XLA ops per chunk of slots, whose dispatch cost (not FLOPs) dominated
// attention in a decode / verification step (4.5 ms of a 25 ms 1-token step at 256 cached
// slots).
//
//   q [B, T, Nkv, G, H], k_all / v_all [L, B, Nkv, S, H], layer int32[], positions int32[B, T],
//   window int32[]; attributes scale (0: 1/sqrt(H)) and softcap (0: off)
//   -> o [B, T, Nkv, G, H];  query (b, t, kv, g) at p = positions[b, t] sees slots
//   p - window < s <= p (s < S); scores are (q . k) * scale, then softcap * tanh(. / softcap).
//
// SpecjaxTreeAttention (draft-tree verification; models/llama.py:_tree_visible) takes three
// more operands, lengths int32[B], mask bool[B, T, W] and region_depth int32[B, W], and sees
// instead: the prefix slots s < lengths[b] with s > p - window, and the region slots
// s = lengths[b] + w (w < W, s < S) with mask[b, t, w] and lengths[b] + region_depth[b, w]
// > p - window; nothing at or past lengths[b] + W. Scores are computed for the slots from
// the lowest visible prefix slot to the last region slot, the invisible ones set to -inf
// before the softmax (their weights are then exactly 0 in the sum over V). A query row that
// sees no slot at all gets zeros. The causal handler runs the same code with no tree, so its
// results are unchanged by the tree case.
//
// Same law as models/llama.py:cached_attention (softmax in float32, max-subtracted), in a
// fixed order per query row that does not depend on the batch or on the other rows. Above
// kMinParallelFlops the work is split over (b, kv head) pairs, and each pair's query rows
// into parts when there are few pairs, between the caller and threads - 1 pool helpers.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using specjax_kernels::load16;
using specjax_kernels::RunTasks;
using specjax_kernels::store16;
using specjax_kernels::v16;

typedef int32_t v16i __attribute__((vector_size(64)));

#if defined(__AVX512F__)
using vi = v16i;
#else
typedef int32_t v8i __attribute__((vector_size(32)));
using vi = v8i;
#endif
using specjax_kernels::kLanes;
using specjax_kernels::kParts;
using specjax_kernels::loadv;
using specjax_kernels::storev;
using specjax_kernels::vf;

// exp for a vector of floats: Cody-Waite range reduction + degree-6 polynomial (~2 ulp),
// inputs <= 0 here (max-subtracted scores); underflows cleanly to 0 below -87.
inline vf vexp(vf x) {
  const vf lo = vf{} - 87.3f;
  x = x < lo ? lo : x;
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  vf y = p * scale;
  return x <= lo ? vf{} : y;
}

// In-place transpose of a 16 x 16 block held as 16 row vectors: four butterfly stages, each
// swapping bit S of the row and column index where they differ (two-input shuffles).
#define SJ_T1_LO 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define SJ_T1_HI 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define SJ_T2_LO 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define SJ_T2_HI 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define SJ_T4_LO 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define SJ_T4_HI 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define SJ_T8_LO 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define SJ_T8_HI 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define SJ_STAGE(S)                                         \
  for (int r = 0; r < 16; ++r)                              \
    if (!(r & S)) {                                         \
      const v16 x = a[r], y = a[r + S];                     \
      a[r] = __builtin_shufflevector(x, y, SJ_T##S##_LO);   \
      a[r + S] = __builtin_shufflevector(x, y, SJ_T##S##_HI); \
    }
inline void Transpose16(v16* a) {
  SJ_STAGE(1)
  SJ_STAGE(2)
  SJ_STAGE(4)
  SJ_STAGE(8)
}
#undef SJ_STAGE

constexpr int kRowBlock = 8;  // query rows per score block (and the unit of the task split below)
// ... of which one ScoreRows call takes (AVX2: 6, so that their accumulators, two vectors a
// row, and the slot block's two fit in 16 registers)
constexpr int kScoreRows = kLanes == 16 ? kRowBlock : 6;
static_assert(kScoreRows <= 8, "ScoreRows below has cases for 1..8 rows");
constexpr int64_t kPrefetchSlots = 48;  // K prefetch distance in slots
constexpr double kMinParallelFlops = 2e6;  // attention below this runs on the calling thread

template <int R>
inline void ScoreRowsT(const float* const* qr, const float* kt, int64_t H, float scale, float* out,
                       int64_t stride) {
  vf acc[R][kParts];
  for (int j = 0; j < R; ++j)
    for (int u = 0; u < kParts; ++u) acc[j][u] = vf{};
  for (int64_t i = 0; i < H; ++i) {
    vf kv[kParts];
    for (int u = 0; u < kParts; ++u) kv[u] = loadv(kt + i * 16 + u * kLanes);
    for (int j = 0; j < R; ++j)
      for (int u = 0; u < kParts; ++u) acc[j][u] += qr[j][i] * kv[u];
  }
  for (int j = 0; j < R; ++j)
    for (int u = 0; u < kParts; ++u) storev(out + j * stride + u * kLanes, acc[j][u] * scale);
}

// out[j * stride + 0:16] = (q_j . kt[:, 0:16]) * scale for j < nr
inline void ScoreRows(int nr, const float* const* qr, const float* kt, int64_t H, float scale, float* out,
                      int64_t stride) {
  switch (nr) {
    case 8: return ScoreRowsT<8>(qr, kt, H, scale, out, stride);
    case 7: return ScoreRowsT<7>(qr, kt, H, scale, out, stride);
    case 6: return ScoreRowsT<6>(qr, kt, H, scale, out, stride);
    case 5: return ScoreRowsT<5>(qr, kt, H, scale, out, stride);
    case 4: return ScoreRowsT<4>(qr, kt, H, scale, out, stride);
    case 3: return ScoreRowsT<3>(qr, kt, H, scale, out, stride);
    case 2: return ScoreRowsT<2>(qr, kt, H, scale, out, stride);
    default: return ScoreRowsT<1>(qr, kt, H, scale, out, stride);
  }
}

// orow[0:16 HV] = inv * sum_{s < vis} w[s] * v[s, 0:16 HV]  (H = 16 HV; accumulators in registers)
template <int HV>
inline void WeightedSum(const float* __restrict w, const float* __restrict v, int64_t vis, float inv,
                        float* __restrict orow) {
  constexpr int NV = HV * kParts;
  vf acc[NV];
  for (int c = 0; c < NV; ++c) acc[c] = vf{};
  for (int64_t s = 0; s < vis; ++s) {
    const float ws = w[s];
    const float* vs = v + s * 16 * HV;
    for (int c = 0; c < NV; ++c) acc[c] += ws * loadv(vs + kLanes * c);
  }
  for (int c = 0; c < NV; ++c) storev(orow + kLanes * c, acc[c] * inv);
}

struct Dims {
  int64_t B, T, Nkv, G, H, L, S;
  int64_t window;   // a query at p sees slots p - window < s <= p
  float scale;      // score scale (> 0)
  float softcap;    // 0: off
};

// lowest visible slot of a query at position p (never above its highest, min(p, S - 1))
inline int64_t LowSlot(const Dims& d, int64_t p) {
  const int64_t hi = p < d.S - 1 ? p : d.S - 1;
  const int64_t lo = p - d.window + 1;
  return lo < 0 ? 0 : (lo > hi ? hi : lo);
}

// Tree attention, one batch row: the region is slots len..len+W-1 (those below S)
struct TreeRow {
  int64_t len, W;
  const bool* mask;       // [T, W] of this batch row
  const int32_t* rdepth;  // [W] of this batch row
  int64_t End(const Dims& d) const { return len + W < d.S ? len + W : d.S; }  // past the last slot read
  // lowest slot a query at p may see: the lowest prefix slot in its window, else the region's first
  int64_t Low(const Dims& d, int64_t p) const {
    const int64_t lo = p - d.window + 1, top = len < End(d) ? len : End(d);
    return lo < 0 ? 0 : (lo > top ? top : lo);
  }
  // region slot s (len <= s < End) visible from (t, p)
  bool Sees(const Dims& d, int64_t t, int64_t p, int64_t s) const {
    const int64_t w = s - len;
    return mask[t * W + w] && len + rdepth[w] > p - d.window;
  }
};

// One (b, kv head), query rows [rb, re) of its T x G rows (row r = (t = r / G, g = r % G)):
// each row against slots LowSlot(pos)..min(pos, S-1) (with a tree: tr->Low(pos)..tr->End()-1,
// the invisible ones masked). Scores are computed for the slots from `first` (the lowest
// visible slot over the rows, rounded down to a multiple of 16; 0 without a window) to the
// highest one; sc holds them from `first` on.
void Head(const Dims& d, const float* q, const float* k, const float* v, const int32_t* pos_b,
          int64_t b, int64_t h, int64_t rb, int64_t re, float* o, std::vector<float>& sc,
          const TreeRow* tr = nullptr) {
  const int64_t TG = re - rb, H = d.H;
  int64_t last = 0;  // highest visible slot over the rows
  int64_t first = d.S;  // lowest visible slot over the rows
  if (tr == nullptr) {
    for (int64_t t = rb / d.G; t <= (re - 1) / d.G; ++t) {
      int64_t p = pos_b[t] < d.S - 1 ? pos_b[t] : d.S - 1;
      if (p > last) last = p;
      const int64_t lo = LowSlot(d, pos_b[t]);
      if (lo < first) first = lo;
    }
  } else {  // every row reads up to the region's end
    last = tr->End(d) - 1;
    for (int64_t t = rb / d.G; t <= (re - 1) / d.G; ++t) {
      const int64_t lo = tr->Low(d, pos_b[t]);
      if (lo < first) first = lo;
    }
    if (first > last) {  // no slot to read (an empty prefix and no region slot below S): zeros
      for (int64_t r = rb; r < re; ++r)
        std::memset(o + (((b * d.T + r / d.G) * d.Nkv + h) * d.G + r % d.G) * H, 0, H * sizeof(float));
      return;
    }
  }
  first = first / 16 * 16;
  const int64_t n = last + 1;
  const int64_t n16 = (n - first + 15) / 16 * 16;
  sc.resize(TG * n16);
  const float scale = d.scale;
  // scores[r, s] = q_r . k_s * scale, 16 slots at a time: the block of K is transposed
  // into kt[H][16] so that each query row accumulates 16 slots in one vector.
  thread_local std::vector<float> kt_buf;
  kt_buf.resize(H * 16);
  float* kt = kt_buf.data();
  // K and V of a layer usually come from DRAM (the weights stream evicts them): prefetch K
  // kPrefetchSlots ahead of the score loop, and each block's V for the weighted sums below.
  const int64_t lines = (H * 4 + 63) / 64;
  for (int64_t s = first; s < n && s < first + kPrefetchSlots; ++s)
    for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(k + s * H + c * 16, 0, 3);
  for (int64_t s0 = first; s0 < n; s0 += 16) {
    const int64_t nb = n - s0 < 16 ? n - s0 : 16;
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t sk = s0 + kPrefetchSlots + j;
      if (sk < n)
        for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(k + sk * H + c * 16, 0, 3);
      for (int64_t c = 0; c < lines; ++c) __builtin_prefetch(v + (s0 + j) * H + c * 16, 0, 2);
    }
    if (H % 16 == 0 && kLanes == 16) {
      for (int64_t c = 0; c < H; c += 16) {
        v16 a[16];
        if (nb == 16) {
          for (int64_t j = 0; j < 16; ++j) a[j] = load16(k + (s0 + j) * H + c);
        } else {
          for (int64_t j = 0; j < 16; ++j) a[j] = j < nb ? load16(k + (s0 + j) * H + c) : v16{};
        }
        Transpose16(a);
        for (int64_t i = 0; i < 16; ++i) store16(kt + (c + i) * 16, a[i]);
      }
    } else {
      for (int64_t j = 0; j < 16; ++j)
        for (int64_t i = 0; i < H; ++i) kt[i * 16 + j] = j < nb ? k[(s0 + j) * H + i] : 0.f;
    }
    // kScoreRows rows at a time, each with its own accumulator: one row's 16-slot sum is a
    // chain of H dependent FMAs (latency-bound); interleaving rows makes it throughput-bound.
    // Each row still sums over i in the same order, so results do not depend on the blocking.
    for (int64_t r0 = 0; r0 < TG; r0 += kScoreRows) {
      const int64_t nr = TG - r0 < kScoreRows ? TG - r0 : kScoreRows;
      const float* qr[kScoreRows];
      for (int64_t j = 0; j < nr; ++j) {
        const int64_t t = (rb + r0 + j) / d.G, g = (rb + r0 + j) % d.G;
        qr[j] = q + (((b * d.T + t) * d.Nkv + h) * d.G + g) * H;
      }
      ScoreRows(static_cast<int>(nr), qr, kt, H, scale, sc.data() + r0 * n16 + (s0 - first), n16);
    }
  }
  // per row: softmax over its visible slots, then the weighted sum of V
  for (int64_t r = 0; r < TG; ++r) {
    const int64_t t = (rb + r) / d.G, g = (rb + r) % d.G;
    const int64_t vis = tr ? tr->End(d) : (pos_b[t] < d.S - 1 ? pos_b[t] : d.S - 1) + 1;  // slots lo..vis-1
    const int64_t lo = tr ? tr->Low(d, pos_b[t]) : LowSlot(d, pos_b[t]);
    float* sr = sc.data() + r * n16;  // sr[j] is slot first + j
    const int64_t a = lo - first, e = vis - first;
    if (d.softcap > 0.f)
      for (int64_t j = a; j < e; ++j) sr[j] = d.softcap * std::tanh(sr[j] / d.softcap);
    for (int64_t j = 0; j < a; ++j) sr[j] = -INFINITY;  // below the window
    for (int64_t j = e; j < n16; ++j) sr[j] = -INFINITY;  // masked (and padding)
    if (tr)  // region slots (all >= lo) outside the row's mask or window
      for (int64_t s = tr->len; s < vis; ++s)
        if (!tr->Sees(d, t, pos_b[t], s)) sr[s - first] = -INFINITY;
    vf mv[kParts];
    for (int u = 0; u < kParts; ++u) mv[u] = loadv(sr + u * kLanes);
    for (int64_t s = 16; s < n16; s += 16)
      for (int u = 0; u < kParts; ++u) {
        const vf x = loadv(sr + s + u * kLanes);
        mv[u] = x > mv[u] ? x : mv[u];
      }
    float m = mv[0][0];
    for (int j = 1; j < 16; ++j) m = mv[j / kLanes][j % kLanes] > m ? mv[j / kLanes][j % kLanes] : m;
    float* orow = o + (((b * d.T + t) * d.Nkv + h) * d.G + g) * H;
    if (tr && !(m > -INFINITY)) {  // a row that sees no slot: zeros (never NaN)
      std::memset(orow, 0, H * sizeof(float));
      continue;
    }
    vf lsum[kParts];
    for (int u = 0; u < kParts; ++u) lsum[u] = vf{};
    for (int64_t s = 0; s < n16; s += 16)
      for (int u = 0; u < kParts; ++u) {
        const vf x = vexp(loadv(sr + s + u * kLanes) - m);
        storev(sr + s + u * kLanes, x);
        lsum[u] += x;
      }
    float l = 0.f;
    for (int j = 0; j < 16; ++j) l += lsum[j / kLanes][j % kLanes];
    const float inv = 1.0f / l;
    const float* wr = sr + a;  // weights of slots lo..vis-1
    const float* vr = v + lo * H;
    const int64_t nv = vis - lo;
    if (H == 64) {
      WeightedSum<4>(wr, vr, nv, inv, orow);
    } else if (H == 128) {
      WeightedSum<8>(wr, vr, nv, inv, orow);
    } else if (H == 32) {
      WeightedSum<2>(wr, vr, nv, inv, orow);
    } else if (H == 16) {
      WeightedSum<1>(wr, vr, nv, inv, orow);
    } else {
      for (int64_t i = 0; i < H; ++i) orow[i] = 0.f;
      for (int64_t s = 0; s < nv; ++s) {
        const float w = wr[s];
        const float* vs = vr + s * H;
        for (int64_t i = 0; i < H; ++i) orow[i] += w * vs[i];
      }
      for (int64_t i = 0; i < H; ++i) orow[i] *= inv;
    }
  }
}

struct Job {
  Dims d{};
  const float *q = nullptr, *k = nullptr, *v = nullptr;
  const int32_t* pos = nullptr;
  int64_t layer = 0;
  float* o = nullptr;
  int64_t parts = 1;  // row parts per (b, kv head): tasks = B x Nkv x parts
  // tree attention (SpecjaxTreeAttention); mask == nullptr: causal
  const int32_t* lengths = nullptr;  // [B]
  const bool* mask = nullptr;        // [B, T, W]
  const int32_t* rdepth = nullptr;   // [B, W]
  int64_t W = 0;

  // task i: part (i % parts) of the query rows of (b, kv head) = i / parts
  void Task(int64_t i) const {
    thread_local std::vector<float> sc;
    const int64_t TG = d.T * d.G;
    const int64_t part = i % parts, bh = i / parts;
    const int64_t b = bh / d.Nkv, h = bh % d.Nkv;
    const int64_t off = (((layer * d.B + b) * d.Nkv + h) * d.S) * d.H;
    if (mask == nullptr) {
      Head(d, q, k + off, v + off, pos + b * d.T, b, h, TG * part / parts, TG * (part + 1) / parts, o, sc);
    } else {
      const TreeRow tr{lengths[b], W, mask + b * d.T * W, rdepth + b * W};
      Head(d, q, k + off, v + off, pos + b * d.T, b, h, TG * part / parts, TG * (part + 1) / parts, o, sc, &tr);
    }
  }
};

// The shared body of both handlers: checks, the job, the split into tasks. `tree` null:
// causal attention; else (lengths, mask, region_depth) of the tree (checked here).
struct TreeArgs {
  ffi::Buffer<ffi::S32> lengths;
  ffi::Buffer<ffi::PRED> mask;
  ffi::Buffer<ffi::S32> region_depth;
};

ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_all,
               ffi::Buffer<ffi::F32> v_all, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
               ffi::Buffer<ffi::S32> window, float scale, float softcap, ffi::ResultBuffer<ffi::F32> o,
               const TreeArgs* tree) {
  const auto qd = q.dimensions(), kd = k_all.dimensions(), pd = positions.dimensions();
  const auto vd = v_all.dimensions();
  bool ok = qd.size() == 5 && kd.size() == 5 && vd.size() == 5 && pd.size() == 2 && kd[1] == qd[0] &&
            kd[2] == qd[2] && kd[4] == qd[4] && pd[0] == qd[0] && pd[1] == qd[1];
  for (int i = 0; ok && i < 5; ++i) ok = vd[i] == kd[i];
  if (!ok) return ffi::Error::InvalidArgument("specjax attention: inconsistent shapes");
  Job job;
  const int64_t win = window.typed_data()[0];
  if (win < 1) return ffi::Error::InvalidArgument("specjax attention: window must be >= 1");
  if (!(scale >= 0.f) || !(softcap >= 0.f))
    return ffi::Error::InvalidArgument("specjax attention: negative scale or softcap");
  // scale 0: the default 1/sqrt(H), computed here as it always was (bit-identical results)
  const float sc = scale > 0.f ? scale : 1.0f / std::sqrt(static_cast<float>(qd[4]));
  job.d = Dims{qd[0], qd[1], qd[2], qd[3], qd[4], kd[0], kd[3], win, sc, softcap};
  job.layer = layer.typed_data()[0];
  if (job.layer < 0 || job.layer >= job.d.L)
    return ffi::Error::InvalidArgument("specjax attention: layer index out of range");
  const int32_t* pos = positions.typed_data();
  int64_t maxpos = 0;
  for (int64_t i = 0; i < qd[0] * qd[1]; ++i) {
    if (pos[i] < 0) return ffi::Error::InvalidArgument("specjax attention: negative position");
    maxpos = pos[i] > maxpos ? pos[i] : maxpos;
  }
  int64_t reach = maxpos + 1 < win ? maxpos + 1 : win;  // most slots a query row reads (for the split)
  if (tree) {
    const auto ld = tree->lengths.dimensions(), md = tree->mask.dimensions();
    const auto rd = tree->region_depth.dimensions();
    if (ld.size() != 1 || md.size() != 3 || rd.size() != 2 || ld[0] != qd[0] || md[0] != qd[0] ||
        md[1] != qd[1] || rd[0] != qd[0] || rd[1] != md[2])
      return ffi::Error::InvalidArgument("specjax tree attention: inconsistent tree shapes");
    job.lengths = tree->lengths.typed_data();
    job.mask = tree->mask.typed_data();
    job.rdepth = tree->region_depth.typed_data();
    job.W = md[2];
    int64_t maxlen = 0;
    for (int64_t i = 0; i < qd[0]; ++i) {
      if (job.lengths[i] < 0) return ffi::Error::InvalidArgument("specjax tree attention: negative length");
      maxlen = job.lengths[i] > maxlen ? job.lengths[i] : maxlen;
    }
    reach = (maxlen < win ? maxlen : win) + job.W;
  }
  job.q = q.typed_data();
  job.k = k_all.typed_data();
  job.v = v_all.typed_data();
  job.pos = pos;
  job.o = o->typed_data();
  // Rough FLOPs. Small jobs run on the caller alone (waking the pool costs more than it
  // saves); larger ones go to the caller plus threads - 1 helpers (as in small_matmul: more
  // parties than cores made step times bimodal), with each (b, kv head)'s rows split into
  // parts when there are fewer (b, kv head) pairs than ~2 per thread.
  const int64_t pairs = job.d.B * job.d.Nkv, rows = qd[1] * qd[3];
  const double span = static_cast<double>(reach);
  const double work = 4.0 * pairs * rows * qd[4] * span;
  int64_t threads = pool.num_threads();
  if (threads < 1 || work < kMinParallelFlops) threads = 1;
  int64_t parts = 1;
  while (threads > 1 && pairs * parts < 2 * threads && rows / (2 * parts) >= kRowBlock / 2) parts *= 2;
  job.parts = parts;
  RunTasks(pool, pairs * parts, threads - 1, [&job](int64_t i) { job.Task(i); });
  return ffi::Error::Success();
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_all,
                         ffi::Buffer<ffi::F32> v_all, ffi::Buffer<ffi::S32> layer,
                         ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> window, float scale,
                         float softcap, ffi::ResultBuffer<ffi::F32> o) {
  return Run(pool, q, k_all, v_all, layer, positions, window, scale, softcap, o, nullptr);
}

ffi::Error TreeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_all,
                             ffi::Buffer<ffi::F32> v_all, ffi::Buffer<ffi::S32> layer,
                             ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> window,
                             ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::PRED> mask,
                             ffi::Buffer<ffi::S32> region_depth, float scale, float softcap,
                             ffi::ResultBuffer<ffi::F32> o) {
  const TreeArgs tree{lengths, mask, region_depth};
  return Run(pool, q, k_all, v_all, layer, positions, window, scale, softcap, o, &tree);
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
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxTreeAttention, TreeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
