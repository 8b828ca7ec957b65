// specjax float32 matmul for XLA CPU: y[M, N] = x[M, K] @ w[K, N], built for small M (decode and
// verification steps); above kMaxSmallRows rows BigJob below does the same sums by panels.
//
// Why: XLA's CPU backend runs a 1-row matmul as a streaming matrix-vector loop, but 2..9
// rows as a packed GEMM that reads the weights at ~2/3 of memory bandwidth, so a 5-token
// verification step cost ~1.5x a 1-token decode step although its extra FLOPs are small.
// This kernel streams each weight matrix from memory exactly once for any M:
//   * the K (input) rows are split into a few contiguous ranges (one per thread for wide
//     matrices, two for narrow ones) and wide matrices also into column blocks; the caller
//     and XLA's intra-op pool claim these tasks as they come. Each row range writes its own
//     partial y, and the partials are summed at the end in a fixed order;
//   * within a range, kTileRows rows at a time (kTileRows concurrent sequential streams)
//     and kColBlock columns at a time (so the partial block stays in L1/L2), every 64-column
//     unit keeps up to kMaxRows x 64 accumulators in vector registers (7..9 rows: 32-column
//     units, one pass), and the row tile
//     kPrefetchRows ahead is prefetched so memory traffic overlaps the FMAs.
// The per-element accumulation order depends only on K, N and the thread count, never on M
// or on the other rows (BigJob keeps it), so a row's result does not depend on the batch it
// sits in, bit for bit.
// Vectors are GCC vector extensions (AVX-512 with -march=native where present, else what
// the CPU has). Built on first use by models/cpu_kernels.py.
// Weights may also be float16 (SpecjaxSmallMatmulF16: x and y stay float32, each weight
// vector is widened in registers as it is loaded), which halves the bytes streamed for
// weights that are stored in float16 anyway (the shipped draft head).
// Or GGUF blocks (SpecjaxBlockMatmul): an int8 code per weight and a float32 scale and
// offset per block of 32 input rows and column, each weight vector rebuilt in registers as
// fma(code, scale, offset). For llama.cpp's Q8_0 (d * q), Q4_0 (d * (q - 8)) and Q4_1
// (d * q + m) the product of a float16 scale (11 significant bits) and a code of at most 8
// bits is exact in float32, so the fma rounds once, as gguf's own dequantization does: the
// weights, and with the same summation order y, have the float32 path's bits, from 1.25
// bytes per weight instead of 4. Several register groups rebuild a 64 x 64 unit once into an
// L1 buffer that all of them read; above kMaxSmallRowsBlocks rows BigJob rebuilds its panels.
// Q4 codes (0..15) may come packed two per byte (SpecjaxBlockMatmulQ4, see DequantPacked):
// the same weights from 0.75 bytes each.
#include <immintrin.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using specjax_kernels::kLanes;
using specjax_kernels::kParts;
using specjax_kernels::loadv;
using specjax_kernels::RunTasks;
using specjax_kernels::storev;
using specjax_kernels::vf;

constexpr int kMaxRows = 6;            // x rows per register block of 64-column units
constexpr int kMaxRowsNarrow = 9;      // 32-column units for kMaxRows < M <= kMaxRowsNarrow (measured)
#if defined(__AVX512F__)
constexpr bool kNarrowGroups = true;   // (AVX2: see StreamRows)
#else
constexpr bool kNarrowGroups = false;
#endif
constexpr int64_t kTileRows = 8;       // weight rows per tile (one register group: memory-bound)
// Several register groups (10+ rows: the FMAs outweigh the weight stream): 64-row tiles, so
// a tile's 64-column unit (16 KB) is read from DRAM by the first group and from L1 by the
// others, and the partial sums are loaded and stored 8x less often; the prefetch then runs
// one unit ahead in the same row (the next 256 bytes), so the next unit's rows arrive while
// the groups compute on this one. Measured (all matmuls of a SmolLM2-135M step, in one
// process against 8-row tiles): 10 / 12 / 16 rows 0.79 / 0.70 / 0.64x the time, same bits.
constexpr int64_t kTileRowsMany = 64;
constexpr int64_t kColBlock = 4096;    // columns per partial block (measured: 2048 and 16384 slower)
constexpr int64_t kPrefetchRows = 12;  // prefetch distance in weight rows (8-16 measured alike)
// GGUF blocks, one register group of 3..9 rows (one byte per weight, and rebuilding a weight
// costs ~3 vector ops, so the vector ops, not the bytes, bound the pass): 64-row tiles, so
// the accumulators are loaded and stored 8x less often, with the codes prefetched
// kPrefetchBytesBlocks ahead in the same row (two lines: the next units of this tile), since
// rows ahead now lie in the same unit and arrive too late (one line ahead measured ~1.5x
// slower). Measured (scripts/bench_matmul_builds.py --blocks: all matmuls of a SmolLM2-135M
// step, one process alternating builds, same bits): 4 / 8 rows 0.81 / 0.80-0.82x the time of
// 8-row tiles with row-ahead prefetch. 1-2 rows (memory-bound) keep those: 64-row tiles
// measured 1.02-1.07x there.
constexpr int64_t kTileRowsBlocks = 64;
constexpr int64_t kPrefetchBytesBlocks = 128;
// Q4 codes packed two per byte (half the bytes of int8 codes): 64-row tiles at every M, the
// codes prefetched one line ahead in the row (chosen in a one-off harness with every matrix
// of a step as Q4). Measured (scripts/bench_matmul_builds.py --blocks --packed: the step's
// layers packed, its Q8_0 head int8): 0.90-0.92 / 0.90-0.96 / 0.92-0.95x the time of int8
// codes at 1 / 2 / 4 rows; a one-row pass is then bound by the rebuild's vector ops.
constexpr int64_t kPrefetchBytesPacked = 64;
constexpr int64_t kMaxChunks = 8;

// p[t, 0:16 NV] (+)= sum_{r < rows} xt[r * xs + t] * w[r * n + 0:16 NV]   (t < TM)
// NV = 4 (64-column units, up to 6 rows) or 2 (32-column units, up to 9 rows, so that 7..9
// rows still read each weight row once; up to 12 rows x 2 accumulators + 2 weight vectors
// would fit in the 32 vector registers, but 10-12 rows measured slower than 6-row groups).
inline vf LoadW(const float* p) { return loadv(p); }
// float16 -> float32 with the F16C/AVX-512 conversion instruction (GCC lowers a generic
// _Float16 vector conversion to a library call per element on CPUs without AVX512-FP16)
inline vf LoadW(const uint16_t* p) {
  vf v;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &f, sizeof(v));
#elif defined(__F16C__)
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &f, sizeof(v));
#else  // never called: the float16 handler refuses to run (models/cpu_kernels.py checks first)
  (void)p;
  v = vf{};
#endif
  return v;
}
#if defined(__AVX512F__) || defined(__F16C__)
constexpr bool kHaveF16 = true;
#else
constexpr bool kHaveF16 = false;
#endif

// WS: the weights' row stride when not n (a rebuilt unit of GGUF blocks, see Job)
template <int TM, int NV, bool NEXT_UNIT = false, class W, int64_t WS = 0>
inline void Micro(const float* __restrict xt, int64_t xs, const W* __restrict w, int64_t rows, int64_t n,
                  float* __restrict p, bool first) {
#if !defined(__AVX512F__)
  // 16 vector registers of 8 floats (AVX2): a v16 takes two, and TM x NV accumulators with
  // NV weight vectors beyond 14 registers spill to the stack on every FMA. Split the block
  // by columns, then by rows, until it fits: each element still gets the same FMAs in the
  // same order (the weights are read again from L1).
  if constexpr (NV > 1 && 2 * NV * (TM + 1) > 14) {
    Micro<TM, NV / 2, NEXT_UNIT, W, WS>(xt, xs, w, rows, n, p, first);
    Micro<TM, NV / 2, NEXT_UNIT, W, WS>(xt, xs, w + 8 * NV, rows, n, p + 8 * NV, first);
    return;
  } else if constexpr (NV == 1 && TM > 6) {
    Micro<6, 1, NEXT_UNIT, W, WS>(xt, xs, w, rows, n, p, first);
    Micro<TM - 6, 1, NEXT_UNIT, W, WS>(xt + 6, xs, w, rows, n, p + 6 * n, first);
    return;
  }
#endif
  constexpr int NW = NV * kParts;  // vectors per row of the block (vf: common.h)
  const int64_t ws = WS ? WS : n;
  vf acc[TM][NW];
  for (int t = 0; t < TM; ++t)
    for (int j = 0; j < NW; ++j) acc[t][j] = first ? vf{} : loadv(p + t * n + kLanes * j);
  for (int64_t r = 0; r < rows; ++r) {
    const W* wr = w + r * ws;
    // may point past the end: prefetch never faults. Into L2/L3 (locality 1), not L1: with
    // L1 prefetches a 5-row step ran ~20% slower (the FMAs and the stream then compete).
    // NEXT_UNIT: the same row of the next column unit (several register groups, see
    // kTileRowsMany), else kPrefetchRows rows ahead in this unit.
    const W* pf = NEXT_UNIT ? wr + 16 * NV : wr + kPrefetchRows * ws;
    for (int j = 0; j < NV; ++j) __builtin_prefetch(pf + 16 * j, 0, 1);
    vf wv[NW];
    for (int j = 0; j < NW; ++j) wv[j] = LoadW(wr + kLanes * j);
    for (int t = 0; t < TM; ++t) {
      const float b = xt[r * xs + t];
      for (int j = 0; j < NW; ++j) acc[t][j] += b * wv[j];
    }
  }
  for (int t = 0; t < TM; ++t)
    for (int j = 0; j < NW; ++j) storev(p + t * n + kLanes * j, acc[t][j]);
}

// Micro<tm, NV> for a runtime tm in 1..TM
template <int NV, int TM, bool NEXT_UNIT = false, class W, int64_t WS = 0>
inline void MicroUpTo(int tm, const float* xt, int64_t xs, const W* w, int64_t rows, int64_t n, float* p,
                      bool first) {
  if constexpr (TM > 1) {
    if (tm < TM) return MicroUpTo<NV, TM - 1, NEXT_UNIT, W, WS>(tm, xt, xs, w, rows, n, p, first);
  }
  Micro<TM, NV, NEXT_UNIT, W, WS>(xt, xs, w, rows, n, p, first);
}

// GGUF blocks: the weight rows of a block of kBlockRows input rows share a scale and offset
// per column (code: int8, row-major like a float weight; scale, offset: [K / kBlockRows, N])
constexpr int64_t kBlockRows = 32;

// GGUF weights are rebuilt as fma(code, scale, offset) with one rounding (the product is
// exact), kLanes at a time (vf: 16 floats with AVX-512, 8 with AVX2 and FMA), else one by
// one: the same value, lane for lane, on every path.
#if defined(__AVX512F__)
using NativeF = __m512;
inline NativeF Widen(const int8_t* c) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
}
inline void WidenNibbles(const uint8_t* c, NativeF& lo, NativeF& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
inline NativeF Fma(NativeF a, NativeF b, NativeF c) { return _mm512_fmadd_ps(a, b, c); }
#define SPECJAX_VECTOR_REBUILD 1
#elif defined(__AVX2__) && defined(__FMA__)
using NativeF = __m256;
inline NativeF Widen(const int8_t* c) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
}
inline void WidenNibbles(const uint8_t* c, NativeF& lo, NativeF& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
inline NativeF Fma(NativeF a, NativeF b, NativeF c) { return _mm256_fmadd_ps(a, b, c); }
#define SPECJAX_VECTOR_REBUILD 1
#endif

// fma(code, s, o) for the kLanes int8 codes at c
inline vf Dequant(const int8_t* c, vf s, vf o) {
  vf r;
#if defined(SPECJAX_VECTOR_REBUILD)
  static_assert(sizeof(NativeF) == sizeof(vf));
  NativeF sv, ov;
  std::memcpy(&sv, &s, sizeof(sv));
  std::memcpy(&ov, &o, sizeof(ov));
  const NativeF w = Fma(Widen(c), sv, ov);
  std::memcpy(&r, &w, sizeof(r));
#else
  for (int i = 0; i < kLanes; ++i) r[i] = __builtin_fmaf(static_cast<float>(c[i]), s[i], o[i]);
#endif
  return r;
}

// Q4 codes (0..15) packed two per byte (C = uint8_t): byte j of each 32-column group holds
// column j in its low and column j + 16 in its high nibble, so one 16-byte load, an and and a
// shift give two weight vectors. Same weights as the int8 codes (C = int8_t), half the bytes.
template <class C>
constexpr int64_t kPerByte = std::is_same_v<C, uint8_t> ? 2 : 1;  // codes per byte
template <class W>
constexpr bool kIsBlocks = std::is_same_v<W, int8_t> || std::is_same_v<W, uint8_t>;

// kLanes bytes of packed codes: w0 from their low nibbles (scale s0, offset o0), w1 from
// their high ones (s1, o1)
inline void DequantPacked(const uint8_t* c, vf s0, vf o0, vf s1, vf o1, vf& w0, vf& w1) {
#if defined(SPECJAX_VECTOR_REBUILD)
  NativeF lo, hi, c0, d0, c1, d1;
  WidenNibbles(c, lo, hi);
  std::memcpy(&c0, &s0, sizeof(c0));
  std::memcpy(&d0, &o0, sizeof(d0));
  std::memcpy(&c1, &s1, sizeof(c1));
  std::memcpy(&d1, &o1, sizeof(d1));
  const NativeF a = Fma(lo, c0, d0), b = Fma(hi, c1, d1);
  std::memcpy(&w0, &a, sizeof(w0));
  std::memcpy(&w1, &b, sizeof(w1));
#else
  for (int i = 0; i < kLanes; ++i) {
    w0[i] = __builtin_fmaf(static_cast<float>(c[i] & 15), s0[i], o0[i]);
    w1[i] = __builtin_fmaf(static_cast<float>(c[i] >> 4), s1[i], o1[i]);
  }
#endif
}

// the NV * kParts weight vectors of one code row (16 NV columns) rebuilt with their scales /
// offsets (vector q covers columns kLanes q .. kLanes q + kLanes - 1)
template <int NV>
inline void DequantRow(const int8_t* wr, const vf* s, const vf* o, vf* wv) {
  for (int q = 0; q < NV * kParts; ++q) wv[q] = Dequant(wr + kLanes * q, s[q], o[q]);
}
template <int NV>
inline void DequantRow(const uint8_t* wr, const vf* s, const vf* o, vf* wv) {
  static_assert(NV % 2 == 0, "packed codes come in 32-column groups");
  for (int h = 0; h < NV / 2; ++h)
    for (int q = 0; q < kParts; ++q) {  // columns 32h + kLanes q.. (low nibbles) and 32h + 16 + kLanes q..
      const int lo = 2 * h * kParts + q, hi = (2 * h + 1) * kParts + q;
      DequantPacked(wr + 16 * h + kLanes * q, s[lo], o[lo], s[hi], o[hi], wv[lo], wv[hi]);
    }
}

#if !defined(__AVX512F__) && defined(SPECJAX_VECTOR_REBUILD)
// AVX2 and FMA (16 registers of 8 floats), packed Q4 codes, 2..6 rows (the register groups
// there: see kNarrowGroups): the group computes one piece of 16 columns at a time over the
// tile's rows, the two vectors of 8 bytes of codes (low nibbles: columns c.., high ones:
// c + 16..), each rebuilt once per row and used by every row of the group. Up to 4 rows the
// TM x 2 accumulators, the two weights, their scales and offsets and a broadcast fit in
// the registers; at 5-6 rows some of them spill to L1, and that still measured faster.
// MicroBlock's split by rows would rebuild each weight once per part, and a 16-byte load of
// packed codes feeds 32 columns, more accumulators than fit. Every element gets the same
// FMAs in the same order as in MicroBlock, so the same bits. Measured in BENCHMARKS.md,
// "The packed block kernel on AVX2 at 2-9 rows".
constexpr int kPiecesFrom = 2;  // one row keeps MicroBlock (by pieces measured 1.2x slower)

template <int TM>
inline void PackedPiece(const float* __restrict xt, int64_t xs, const uint8_t* __restrict w,
                        const float* __restrict sc, const float* __restrict of, int64_t row0, int64_t rows,
                        int64_t n, float* __restrict p, bool first, int64_t c0, bool prefetch) {
  const int64_t stride = n / 2, col[2] = {c0, c0 + 16};
  vf acc[TM][2];
  for (int t = 0; t < TM; ++t)
    for (int v = 0; v < 2; ++v) acc[t][v] = first ? vf{} : loadv(p + t * n + col[v]);
  for (int64_t r = 0; r < rows;) {  // by blocks of kBlockRows input rows: one scale / offset
    const int64_t b = (row0 + r) / kBlockRows;
    const int64_t end = (b + 1) * kBlockRows - row0 < rows ? (b + 1) * kBlockRows - row0 : rows;
    vf s[2], o[2];
    for (int v = 0; v < 2; ++v) {
      s[v] = loadv(sc + b * n + col[v]);
      o[v] = loadv(of + b * n + col[v]);
    }
    for (; r < end; ++r) {
      const uint8_t* wr = w + r * stride;
      if (prefetch) __builtin_prefetch(wr + kPrefetchBytesPacked, 0, 1);
      vf wv[2];
      DequantPacked(wr, s[0], o[0], s[1], o[1], wv[0], wv[1]);
      for (int t = 0; t < TM; ++t) {
        const float xv = xt[r * xs + t];
        for (int v = 0; v < 2; ++v) acc[t][v] += xv * wv[v];
      }
    }
  }
  for (int t = 0; t < TM; ++t)
    for (int v = 0; v < 2; ++v) storev(p + t * n + col[v], acc[t][v]);
}

// MicroBlock's NV 16-column blocks of packed codes (w, sc, of and p at its column 0) by
// pieces; the first piece's pass prefetches the codes as MicroBlock does
template <int TM, int NV>
inline void MicroBlockPieces(const float* xt, int64_t xs, const uint8_t* w, const float* sc, const float* of,
                             int64_t row0, int64_t rows, int64_t n, float* p, bool first) {
  static_assert(kLanes == 8 && NV % 2 == 0, "AVX2 pieces: 8-float vectors, 32-column groups");
  for (int j = 0; j < NV; ++j)  // the 8 bytes at 16 (j / 2) + 8 (j % 2)
    PackedPiece<TM>(xt, xs, w + 16 * (j / 2) + 8 * (j % 2), sc, of, row0, rows, n, p, first,
                    32 * (j / 2) + 8 * (j % 2), j == 0);
}
#endif

// Micro with w[r, :] = fma(code[r, :], scale[b, :], offset[b, :]), b = (row0 + r) / kBlockRows
// (row0: the input row of this tile's first row); the same sums as Micro over those weights.
// For one register group (up to 9 rows): rebuilding into an L1 buffer and reading it back,
// as several groups do, measured 1.2-1.4x slower at 1-9 rows.
template <int TM, int NV, class C>
inline void MicroBlock(const float* __restrict xt, int64_t xs, const C* __restrict w,
                       const float* __restrict sc, const float* __restrict of, int64_t row0, int64_t rows,
                       int64_t n, float* __restrict p, bool first) {
#if !defined(__AVX512F__) && defined(SPECJAX_VECTOR_REBUILD)
  if constexpr (kPerByte<C> == 2 && TM >= kPiecesFrom && TM <= kMaxRows) {
    return MicroBlockPieces<TM, NV>(xt, xs, w, sc, of, row0, rows, n, p, first);
  }
#endif
#if !defined(__AVX512F__)
  // AVX2 (16 registers of 8 floats): split as Micro does, by columns down to one 16-column
  // block (packed codes: one 32-column group) while the accumulators, the weights and their
  // scales and offsets would not fit, then by rows while the accumulators and the weights
  // would not; each part rebuilds its own weights, with the same values, and every element
  // gets the same FMAs in the same order.
  constexpr int kMinNV = kPerByte<C> == 2 ? 2 : 1;
  if constexpr (NV > kMinNV && 2 * NV * (TM + 3) > 14) {
    constexpr int H = NV / 2;
    MicroBlock<TM, H, C>(xt, xs, w, sc, of, row0, rows, n, p, first);
    MicroBlock<TM, H, C>(xt, xs, w + 16 * H / kPerByte<C>, sc + 16 * H, of + 16 * H, row0, rows, n, p + 16 * H,
                         first);
    return;
  } else if constexpr (NV == kMinNV && 2 * NV * (TM + 1) > 14) {
    constexpr int R = 7 / NV - 1;  // rows that fit: 6 (16 columns), 2 (32)
    MicroBlock<R, NV, C>(xt, xs, w, sc, of, row0, rows, n, p, first);
    MicroBlock<TM - R, NV, C>(xt + R, xs, w, sc, of, row0, rows, n, p + R * n, first);
    return;
  }
#endif
  constexpr int NW = NV * kParts;  // vectors per row of the block
  vf acc[TM][NW];
  for (int t = 0; t < TM; ++t)
    for (int j = 0; j < NW; ++j) acc[t][j] = first ? vf{} : loadv(p + t * n + kLanes * j);
  vf s[NW], o[NW];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t ra = row0 + r;
    if (r == 0 || ra % kBlockRows == 0) {
      const int64_t b = ra / kBlockRows;
      for (int j = 0; j < NW; ++j) {
        s[j] = loadv(sc + b * n + kLanes * j);
        o[j] = loadv(of + b * n + kLanes * j);
      }
    }
    const C* wr = w + r * (n / kPerByte<C>);
    if constexpr (kPerByte<C> == 2)  // packed: 64-row tiles at any M, one line ahead in the row
      __builtin_prefetch(wr + kPrefetchBytesPacked, 0, 1);
    else if constexpr (TM <= 2)  // 1-2 rows: 8-row tiles, the rows ahead (see kTileRowsBlocks)
      __builtin_prefetch(wr + kPrefetchRows * n, 0, 1);
    else
      __builtin_prefetch(wr + kPrefetchBytesBlocks, 0, 1);  // this row, units ahead
    vf wv[NW];
    DequantRow<NV>(wr, s, o, wv);
    for (int t = 0; t < TM; ++t) {
      const float b = xt[r * xs + t];
      for (int j = 0; j < NW; ++j) acc[t][j] += b * wv[j];
    }
  }
  for (int t = 0; t < TM; ++t)
    for (int j = 0; j < NW; ++j) storev(p + t * n + kLanes * j, acc[t][j]);
}

template <int NV, int TM, class C>
inline void MicroBlockUpTo(int tm, const float* xt, int64_t xs, const C* w, const float* sc, const float* of,
                           int64_t row0, int64_t rows, int64_t n, float* p, bool first) {
  if constexpr (TM > 1) {
    if (tm < TM) return MicroBlockUpTo<NV, TM - 1, C>(tm, xt, xs, w, sc, of, row0, rows, n, p, first);
  }
  MicroBlock<TM, NV, C>(xt, xs, w, sc, of, row0, rows, n, p, first);
}

// rows x 64 columns of GGUF blocks (code at w, row stride n; sc / of at the same column,
// row0 the input row of the first row) rebuilt as float32 into out (row stride 64); each row
// prefetches the codes pf bytes after it (Job: the same row one int8 unit, 64 bytes, ahead;
// BigJob's panel: rows ahead in this unit)
template <class C>
inline void DequantUnit(const C* __restrict w, const float* __restrict sc, const float* __restrict of,
                        int64_t row0, int64_t rows, int64_t n, float* __restrict out, int64_t pf = 64) {
  constexpr int NW = 4 * kParts;
  vf s[NW], o[NW];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t ra = row0 + r;
    if (r == 0 || ra % kBlockRows == 0) {
      const int64_t b = ra / kBlockRows;
      for (int j = 0; j < NW; ++j) {
        s[j] = loadv(sc + b * n + kLanes * j);
        o[j] = loadv(of + b * n + kLanes * j);
      }
    }
    const C* wr = w + r * (n / kPerByte<C>);
    __builtin_prefetch(wr + pf, 0, 1);
    vf wv[NW];
    DequantRow<4>(wr, s, o, wv);
    for (int j = 0; j < NW; ++j) storev(out + r * 64 + kLanes * j, wv[j]);
  }
}

// What both paths below (Job, BigJob) compute from: MatmulCore fills it once, each path sets
// xt to x transposed for its own groups of rows.
template <class W>
struct Operands {
  const W* w = nullptr;       // weights [K, N] (GGUF blocks: the codes, W = int8_t; uint8_t: [K, N / 2] packed)
  const float* sc = nullptr;  // GGUF blocks: scale and offset [K / kBlockRows, N]
  const float* of = nullptr;
  const float* xt = nullptr;  // [groups][K][rows per group], x transposed per group of rows
  int64_t m = 0, k = 0, n = 0;
  int64_t chunks = 0;         // K ranges, summed apart and added in order
};

template <class W>
struct Job {
  Operands<W> op;
  int64_t gr = kMaxRows;     // rows per register group: kMaxRows (64-column units) or kMaxRowsNarrow (32)
  float* out[kMaxChunks] = {};  // per-chunk partial y [m, n]

  int64_t col_blocks = 1;        // tasks = chunks x col_blocks, claimed dynamically

  // rows [k0, k1) of chunk c times columns [c0, c1) of block j, into partial out[c]
  void Task(int64_t task) const {
    const auto& [w, sc, of, xt, m, k, n, chunks] = op;
    const int64_t c = task % chunks, j = task / chunks;
    const int64_t k0 = k * c / chunks, k1 = k * (c + 1) / chunks;
    const int64_t c0 = j * kColBlock, c1 = c0 + kColBlock < n ? c0 + kColBlock : n;
    float* p = out[c];
    const bool narrow = gr == kMaxRowsNarrow;
    const int64_t groups = (m + gr - 1) / gr, unit = narrow ? 32 : 64;
    const int64_t tile = groups > 1                                          ? kTileRowsMany
                         : kIsBlocks<W> && (m > 2 || kPerByte<W> == 2) ? kTileRowsBlocks
                                                                          : kTileRows;
    alignas(64) float unit_buf[kIsBlocks<W> ? kTileRowsMany * 64 : 1];  // GGUF blocks: a rebuilt unit
    for (int64_t r0 = k0; r0 < k1; r0 += tile) {
      const int64_t rows = k1 - r0 < tile ? k1 - r0 : tile;
      const W* w_tile = w + r0 * (n / kPerByte<W>);
      for (int64_t u = c0; u < c1; u += unit)
        for (int64_t g = 0; g < groups; ++g) {
          const int tm = static_cast<int>(m - g * gr < gr ? m - g * gr : gr);
          const float* xg = xt + (g * k + r0) * gr;
          float* pg = p + g * gr * n + u;
          if constexpr (kIsBlocks<W>) {
            const W* wu = w_tile + u / kPerByte<W>;
            if (groups > 1) {
              // several register groups: the unit is rebuilt once (first group) into an L1
              // buffer that every group reads, instead of once per group
              if (g == 0) DequantUnit(wu, sc + u, of + u, r0, rows, n, unit_buf);
              MicroUpTo<4, kMaxRows, false, float, 64>(tm, xg, gr, unit_buf, rows, n, pg, r0 == k0);
            } else if (narrow) {  // one register group: the weights rebuilt as they stream
              MicroBlockUpTo<2, kMaxRowsNarrow>(tm, xg, gr, wu, sc + u, of + u, r0, rows, n, pg, r0 == k0);
            } else {
              MicroBlockUpTo<4, kMaxRows>(tm, xg, gr, wu, sc + u, of + u, r0, rows, n, pg, r0 == k0);
            }
          } else if (narrow) {
            MicroUpTo<2, kMaxRowsNarrow>(tm, xg, gr, w_tile + u, rows, n, pg, r0 == k0);
          } else if (groups > 1) {
            MicroUpTo<4, kMaxRows, true>(tm, xg, gr, w_tile + u, rows, n, pg, r0 == k0);
          } else {
            MicroUpTo<4, kMaxRows>(tm, xg, gr, w_tile + u, rows, n, pg, r0 == k0);
          }
        }
    }
  }

};

// Many rows (M > kMaxSmallRows): the same sums as Job, element by element, but split by
// 64-column units and blocks of rows instead of K ranges. Streaming the weights once no
// longer pays when there are many rows (the FMAs dominate), and Job's partial y arrays
// ([M, N] per K range) would not fit in any cache. Here a task copies one 64-column panel
// of w into a contiguous buffer (read kRowBlockGroups groups of rows times from L1/L2) and,
// for each group of rows, runs the same Micro over each K range [k0, k1) of Job (from zero,
// in the same order) and adds the ranges' results in the same order (y = p0 + p1 + ...).
// Hence a row's result is bit-identical whichever path, and whatever M, computes it.
// Job (weights streamed once) up to this many rows. With Job's 64-row tiles and next-unit
// prefetch, streaming still beats the packed panels up to ~64 rows (all matmuls of a
// SmolLM2-135M step, one process alternating builds: 17 / 32 / 48 / 64 rows 0.62 / 0.78 /
// 0.87 / 0.95x the time of BigJob; 96 / 128 rows 1.04 / 1.10x).
constexpr int64_t kMaxSmallRows = 64;
// GGUF blocks: the panels from 24 rows on. A panel is rebuilt once per task with its rows
// prefetched kPrefetchRowsPanel ahead, where Job rebuilds each 64 x 64 unit between the
// groups' passes and loads and stores their partial sums per 64-row tile. Measured
// (scripts/bench_matmul_builds.py --blocks, same bits): 24 / 32 / 48 / 64 rows 0.97 / 0.94 /
// 0.90-0.94 / 0.92-0.94x the time of Job; 17-20 rows 1.05-1.09x (Job kept); the prefetch
// changed nothing above 64 rows.
constexpr int64_t kMaxSmallRowsBlocks = 23;
constexpr int64_t kPrefetchRowsPanel = 16;
constexpr int64_t kRowBlockGroups = 32;  // groups of kMaxRows rows per task

template <class W>
struct BigJob {
  Operands<W> op;  // xt: groups of kMaxRows rows; GGUF blocks: the panel is rebuilt in float32
  float* y = nullptr;
  int64_t groups = 0, row_blocks = 0;

  void Task(int64_t task) const {
    const auto& [w, sc, of, xt, m, k, n, chunks] = op;
    const int64_t u = (task / row_blocks) * 64, rb = task % row_blocks;
    const int64_t g0 = rb * kRowBlockGroups, g1 = g0 + kRowBlockGroups < groups ? g0 + kRowBlockGroups : groups;
    using P = std::conditional_t<kIsBlocks<W>, float, W>;
    thread_local std::vector<P> panel;
    panel.resize(k * 64);
    if constexpr (kIsBlocks<W>)
      DequantUnit(w + u / kPerByte<W>, sc + u, of + u, 0, k, n, panel.data(), kPrefetchRowsPanel * (n / kPerByte<W>));
    else
      for (int64_t r = 0; r < k; ++r) std::memcpy(panel.data() + r * 64, w + r * n + u, 64 * sizeof(W));
    alignas(64) float tmp[kMaxRows * 64];
    for (int64_t g = g0; g < g1; ++g) {
      const int tm = static_cast<int>(m - g * kMaxRows < kMaxRows ? m - g * kMaxRows : kMaxRows);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t k0 = k * c / chunks, k1 = k * (c + 1) / chunks;
        MicroUpTo<4, kMaxRows>(tm, xt + (g * k + k0) * kMaxRows, kMaxRows, panel.data() + k0 * 64, k1 - k0, 64,
                               tmp, true);
        for (int t = 0; t < tm; ++t) {
          float* yr = y + (g * kMaxRows + t) * n + u;
          const float* pr = tmp + t * 64;
          if (c == 0)
            std::memcpy(yr, pr, 64 * sizeof(float));
          else
            for (int i = 0; i < 64; ++i) yr[i] += pr[i];
        }
      }
    }
  }
};

// x[M, K] transposed per group of gr rows into buf: [groups][K][gr], zero-padded
inline void TransposeGroups(const float* xp, int64_t m, int64_t k, int64_t gr, std::vector<float>& buf) {
  buf.assign(((m + gr - 1) / gr) * k * gr, 0.f);
  for (int64_t g0 = 0; g0 < m; g0 += gr) {  // (no division per element)
    float* dst = buf.data() + g0 * k;  // group g0 / gr: [k][gr]
    const int64_t tm = m - g0 < gr ? m - g0 : gr;
    for (int64_t t = 0; t < tm; ++t) {
      const float* src = xp + (g0 + t) * k;
      for (int64_t i = 0; i < k; ++i) dst[i * gr + t] = src[i];
    }
  }
}

// op with xt = x[M, K] transposed into buf for groups of gr rows
template <class W>
Operands<W> WithX(Operands<W> op, const float* xp, int64_t gr, std::vector<float>& buf) {
  TransposeGroups(xp, op.m, op.k, gr, buf);
  op.xt = buf.data();
  return op;
}

// The streaming path (M <= kMaxSmallRows rows): y[M, N] = x[M, K] @ w[K, N].
template <class W>
void StreamRows(ffi::ThreadPool& pool, int64_t threads, int64_t col_blocks, Operands<W> op, const float* xp,
                float* yp) {
  const int64_t m = op.m, n = op.n, chunks = op.chunks;
  thread_local std::vector<float> xt_buf, partial_buf;
  // up to 6 rows: 64-column units. 7..9 rows: one group with 32-column units, so each weight
  // row is read once (all matmuls of a step at 7 / 8 / 9 rows: 18.5 / 20.6 / 23.7 ms vs
  // 20.0 / 21.8 / 24.6 ms as two 64-column passes). From 10 rows on a 12-row narrow block
  // is compute-bound and slower (12 rows: 33 vs 30 ms), so groups of 6 again. Those times
  // are AVX-512's (32 registers); with AVX2's 16 the narrow group's 9 x 4 accumulators do not
  // fit, and two groups of 64-column units measured 0.69-0.73x its time (float32) and
  // 0.72-0.79x (GGUF blocks) at 7..9 rows (BENCHMARKS.md, "The packed block kernel on AVX2
  // at 2-9 rows"), so there the groups stay at 6 rows.
  const int64_t gr = kNarrowGroups && m > kMaxRows && m <= kMaxRowsNarrow ? kMaxRowsNarrow : kMaxRows;

  // The caller owns these buffers until it returns; helpers only touch them while holding
  // a claimed task, and the caller waits for every task to finish.
  // Work is split into tasks that threads claim as they come (a late-starting helper then
  // costs little): wide matrices by column blocks of one row range per thread, narrow ones
  // (one column block) by two row ranges per thread.
  Job<W> job;
  job.op = WithX(op, xp, gr, xt_buf);
  job.col_blocks = col_blocks;
  job.gr = gr;
  const int64_t stride = (m * n + 15) / 16 * 16;
  partial_buf.resize((chunks - 1) * stride + 16);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(partial_buf.data()) + 63) & ~uintptr_t{63});
  job.out[0] = yp;  // chunk 0 writes y directly; the others add into it below
  for (int64_t c = 1; c < chunks; ++c) job.out[c] = base + (c - 1) * stride;

  RunTasks(pool, chunks * col_blocks, threads - 1, [&job](int64_t t) { job.Task(t); });

  for (int64_t c = 1; c < chunks; ++c) {
    const float* pc = job.out[c];
    for (int64_t i = 0; i < m * n; ++i) yp[i] += pc[i];
  }
}

// y[M, N] = x[M, K] @ w[K, N] for the K x N weights at wp (row-major; GGUF blocks: the codes,
// with sc / of their scales and offsets [K / kBlockRows, N]). Shared by the 2-D handlers and
// the stacked ones, which read one layer of w[L, K, N] in place.
template <ffi::DataType WT, class W>
ffi::Error MatmulCore(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const W* wp, int64_t k, int64_t n,
                      ffi::ResultBuffer<ffi::F32>& y, const float* sc = nullptr, const float* of = nullptr) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] != k || n % 64 != 0 || xd[0] < 1)
    return ffi::Error::InvalidArgument(
        "specjax small_matmul: expected x[M, K] and w[K, N] with N a multiple of 64");
  if constexpr (WT == ffi::F16) {
    if (!kHaveF16) return ffi::Error::InvalidArgument("specjax small_matmul: float16 weights need F16C");
  }
  const int64_t m = xd[0];
  int64_t threads = pool.num_threads();
  if (threads < 1) threads = 1;
  // The K ranges: their number depends only on N, K and the thread count (never on M), and
  // both paths below sum each range from zero and add the ranges in order.
  const int64_t col_blocks = (n + kColBlock - 1) / kColBlock;
  int64_t chunks = col_blocks >= 2 * threads ? threads : 2 * threads;
  if (chunks > kMaxChunks) chunks = kMaxChunks;
  while (chunks > 1 && k / chunks < 2 * kTileRows) --chunks;

  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const Operands<W> op{wp, sc, of, nullptr, m, k, n, chunks};
  if (m > (kIsBlocks<W> ? kMaxSmallRowsBlocks : kMaxSmallRows)) {  // blocks: each task rebuilds its panel once
    thread_local std::vector<float> xt_buf;
    const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
    BigJob<W> job;
    job.op = WithX(op, xp, kMaxRows, xt_buf);
    job.y = yp;
    job.groups = groups;
    job.row_blocks = (groups + kRowBlockGroups - 1) / kRowBlockGroups;
    RunTasks(pool, (n / 64) * job.row_blocks, threads - 1, [&job](int64_t t) { job.Task(t); });
    return ffi::Error::Success();
  }
  StreamRows<W>(pool, threads, col_blocks, op, xp, yp);
  return ffi::Error::Success();
}

template <ffi::DataType WT, class W>
ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("specjax small_matmul: expected w[K, N]");
  return MatmulCore<WT, W>(pool, x, reinterpret_cast<const W*>(w.typed_data()), wd[0], wd[1], y);
}

// Layer `layer` of stacked weights w[L, K, N] (scanned layers), read where it lies: XLA would
// otherwise copy the layer's slice out of the stack on every call (a dynamic slice feeding an
// opaque call is materialized), which doubled the weight traffic of a scanned decode step.
template <ffi::DataType WT, class W>
ffi::Error StackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                             ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 3) return ffi::Error::InvalidArgument("specjax stacked small_matmul: expected w[L, K, N]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument("specjax stacked small_matmul: layer out of range");
  const W* base = reinterpret_cast<const W*>(w.typed_data());
  return MatmulCore<WT, W>(pool, x, base + l * wd[1] * wd[2], wd[1], wd[2], y);
}

// GGUF blocks: x[M, K] @ (code[K, N] rebuilt with scale / offset [K / 32, N]); stacked:
// layer `layer` of code[L, K, N], scale / offset [L, K / 32, N], read in place. Packed Q4
// codes (CT = U8): code[(L,) K, N / 2], two per byte (see DequantPacked).
template <ffi::DataType CT, class C>
ffi::Error BlockCore(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<CT>& code,
                     ffi::Buffer<ffi::F32>& scale, ffi::Buffer<ffi::F32>& offset, int64_t layer, int stacked,
                     ffi::ResultBuffer<ffi::F32>& y) {
  const auto cd = code.dimensions(), sd = scale.dimensions(), od = offset.dimensions();
  const size_t nd = stacked ? 3 : 2;
  if (cd.size() != nd || sd.size() != nd || od.size() != nd)
    return ffi::Error::InvalidArgument("specjax block_matmul: expected code[(L,) K, N] and scale, offset[(L,) K/32, N]");
  const int64_t k = cd[nd - 2], n = cd[nd - 1] * kPerByte<C>;
  for (size_t i = 0; i < nd; ++i)
    if (sd[i] != od[i] || sd[i] != (i == nd - 2 ? k / kBlockRows : i == nd - 1 ? n : cd[i]))
      return ffi::Error::InvalidArgument("specjax block_matmul: scale / offset do not match code[(L,) K, N] in blocks of 32");
  if (k % kBlockRows) return ffi::Error::InvalidArgument("specjax block_matmul: K is not a multiple of 32");
  if (stacked && (layer < 0 || layer >= cd[0]))
    return ffi::Error::InvalidArgument("specjax stacked block_matmul: layer out of range");
  const int64_t l = stacked ? layer : 0;
  const auto* wp = reinterpret_cast<const C*>(code.typed_data()) + l * k * cd[nd - 1];
  const int64_t so = l * (k / kBlockRows) * n;
  return MatmulCore<CT, C>(pool, x, wp, k, n, y, scale.typed_data() + so, offset.typed_data() + so);
}

template <ffi::DataType CT, class C>
ffi::Error BlockMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<CT> code,
                           ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y) {
  return BlockCore<CT, C>(pool, x, code, scale, offset, 0, 0, y);
}

template <ffi::DataType CT, class C>
ffi::Error StackedBlockMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<CT> code,
                                  ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return BlockCore<CT, C>(pool, x, code, scale, offset, layer.typed_data()[0], 1, y);
}

// The arguments every matmul handler binds first: the thread pool, x and the weights (FFI
// type WT; GGUF blocks: the codes), and for blocks their scales and offsets after them.
template <ffi::DataType WT>
auto MatmulArgs() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<WT>>();
}
template <ffi::DataType CT>
auto BlockArgs() {
  return MatmulArgs<CT>().template Arg<ffi::Buffer<ffi::F32>>().template Arg<ffi::Buffer<ffi::F32>>();
}
using Y = ffi::Buffer<ffi::F32>;
using Layer = ffi::Buffer<ffi::S32>;  // the stacked handlers' layer index

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMatmul, (SmallMatmulImpl<ffi::F32, float>), MatmulArgs<ffi::F32>().Ret<Y>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMatmulF16, (SmallMatmulImpl<ffi::F16, uint16_t>),
                              MatmulArgs<ffi::F16>().Ret<Y>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMatmulStacked, (StackedMatmulImpl<ffi::F32, float>),
                              MatmulArgs<ffi::F32>().Arg<Layer>().Ret<Y>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxSmallMatmulStackedF16, (StackedMatmulImpl<ffi::F16, uint16_t>),
                              MatmulArgs<ffi::F16>().Arg<Layer>().Ret<Y>());
// int8 codes, and Q4 codes packed two per byte
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxBlockMatmul, (BlockMatmulImpl<ffi::S8, int8_t>), BlockArgs<ffi::S8>().Ret<Y>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxBlockMatmulStacked, (StackedBlockMatmulImpl<ffi::S8, int8_t>),
                              BlockArgs<ffi::S8>().Arg<Layer>().Ret<Y>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxBlockMatmulQ4, (BlockMatmulImpl<ffi::U8, uint8_t>), BlockArgs<ffi::U8>().Ret<Y>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxBlockMatmulQ4Stacked, (StackedBlockMatmulImpl<ffi::U8, uint8_t>),
                              BlockArgs<ffi::U8>().Arg<Layer>().Ret<Y>());
