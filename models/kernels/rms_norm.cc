// specjax RMSNorm for XLA CPU (float32): y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * (offset + w).
//
// Why a kernel: XLA's reduce picks its summation order (vectorized across the reduced axis,
// across rows, with or without a multiply contracted into the adds) from the whole shape,
// so a row's mean square, hence its bits, changed with the number of rows (the batch).
// Here every row is summed in one fixed order that depends only on D: 16 lane sums
// (lane j takes x[i]^2 for i = j mod 16, in increasing i), then a fixed pairwise tree over
// the lanes. Rows are independent, so the result of a row never depends on the others.
#include <cmath>
#include <cstdint>

#include "common.h"

namespace ffi = xla::ffi;

namespace {

using specjax_kernels::kLanes;
using specjax_kernels::kParts;
using specjax_kernels::loadv;
using specjax_kernels::vf;

ffi::Error RmsNormImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, float eps, float offset,
                       ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 1 || xd[1] != wd[0] || xd[1] < 1)
    return ffi::Error::InvalidArgument("specjax rms_norm: expected x[R, D] and w[D]");
  const int64_t rows = xd[0], d = xd[1], d16 = d / 16 * 16;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * d;
    float* yr = yp + r * d;
    float lane[16];  // lane j sums the squares of elements j, j + 16, ... (vf: common.h)
    vf acc[kParts] = {};
    for (int64_t i = 0; i < d16; i += 16)
      for (int u = 0; u < kParts; ++u) {
        const vf v = loadv(xr + i + u * kLanes);
        acc[u] += v * v;
      }
    std::memcpy(lane, acc, sizeof(lane));
    for (int64_t i = d16; i < d; ++i) lane[i - d16] += xr[i] * xr[i];
    for (int width = 8; width >= 1; width /= 2)
      for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
    const float inv = 1.0f / std::sqrt(lane[0] / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * inv * (offset + wp[i]);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxRmsNorm, RmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Attr<float>("offset")
                                  .Ret<ffi::Buffer<ffi::F32>>());
