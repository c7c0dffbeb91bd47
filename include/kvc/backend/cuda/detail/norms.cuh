// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/detail/norms.cuh: the fp64 rare path of key norms, shared by the Knorm and KeyDiff kernels.
#pragma once

#include <kvc/backend/cuda/config.cuh>

namespace kvc::backend::cuda {

/// sum_i load(k[i], scale)^2 in fp64 over a warp, every lane gets it (lane-strided sums, then the shuffle tree:
/// deterministic). The rare path for rows outside kvc::detail::sum_squares_in_range() (core/norm_range.hpp, the CPU's
/// guard too); call it warp-uniformly.
template <class T, class S>
__device__ double warp_sum_squares_fp64(T const* k, S scale, Index dim, int lane) {
  double sq = 0.0;
  for (Index i = lane; i < dim; i += warp_size) {
    double const x = load(k[i], scale);
    sq += x * x;
  }
  return warp_sum(sq);
}

}  // namespace kvc::backend::cuda
