// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/random.cuh: CUDA kernel of RandomScorer (the same hash as the CPU: identical scores).
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/core/scores.hpp>
#include <kvc/scorers/random.hpp>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

template <class Scorer>
__global__ void random_kernel(Scorer s, ScoreSpan<DeviceSpace> out) {
  Index const b = blockIdx.z, h = blockIdx.y, n = clamp_length(out.length(b, h), out.tokens);
  for (Index t = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; t < out.tokens;
       t += static_cast<Index>(gridDim.x) * blockDim.x)
    out(b, h, t) = t < n ? s.at(b, h, t) : -CUDART_INF_F;
}

}  // namespace kvc::backend::cuda

namespace kvc {

template <>
struct Kernel<RandomScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, RandomScorer const&, KVExtents const&, Obs const&) {
    return 0;
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, RandomScorer const& s, C const&, Obs const&, ScoreSpan<DeviceSpace> out,
                    Workspace) {
    namespace bc = backend::cuda;
    if (out.batch * out.heads == 0 || out.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(
        bc::head_grid_status(out.batch, out.heads, "kvc::score(random, Cuda): batch and heads must be <= 65535"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    dim3 const grid(bc::grid_dim((out.tokens + 255) / 256, 1024), static_cast<unsigned>(out.heads),
                    static_cast<unsigned>(out.batch));
    KVC_RETURN_IF_ERROR(
        bc::launch(KVC_CUDA_KERNEL("kvc::score(random, Cuda)", bc::random_kernel), grid, 256, 0, cuda.stream, s, out));
    return {};
  }
};

}  // namespace kvc
