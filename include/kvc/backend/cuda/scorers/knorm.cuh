// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/scorers/knorm.cuh: CUDA kernel for KnormScorer.
#pragma once

#include <kvc/backend/cuda/config.cuh>
#include <kvc/backend/cuda/detail/norms.cuh>
#include <kvc/core/norm_range.hpp>
#include <kvc/scorers/knorm.hpp>

#include <cstddef>
#include <math_constants.h>

namespace kvc::backend::cuda {

inline constexpr int knorm_warps = 8;

/// Grid (token blocks, heads, batch); one warp per token row, lanes read the row coalesced. A row whose fp32 sum
/// is out of range (detail::sum_squares_in_range, as on the CPU) is summed again in fp64 (a warp-uniform branch) and
/// scored by kvc::knorm_fp64_score, the CPU's formula (-inf for a NaN or Inf key).
template <class Keys>
__global__ void knorm_kernel(Keys keys, ScoreSpan<DeviceSpace> out) {
  Index const dim = keys.extents().dim;
  Index const b = blockIdx.z, h = blockIdx.y;
  int const lane = static_cast<int>(threadIdx.x) % warp_size;
  Index const n = clamp_length(out.length(b, h), head_capacity(keys.layout(), b, h));
  Index const stride = static_cast<Index>(gridDim.x) * knorm_warps;
  auto const ks = keys.scale(b, h);
  for (Index t = static_cast<Index>(blockIdx.x) * knorm_warps + threadIdx.x / warp_size; t < out.tokens; t += stride) {
    float sq = 0.0f;
    if (t < n) {
      auto const* k = keys.row(b, h, t);
      for (Index i = lane; i < dim; i += warp_size) {
        float const x = load(k[i], ks);
        sq += x * x;
      }
    }
    sq = warp_sum(sq);
    float score = t < n ? -sqrtf(sq) : -CUDART_INF_F;
    if (t < n && !detail::sum_squares_in_range(sq)) [[unlikely]]  // warp-uniform: every lane holds the sum
      score = knorm_fp64_score(warp_sum_squares_fp64(keys.row(b, h, t), ks, dim, lane));
    if (lane == 0)
      out(b, h, t) = score;
  }
}

}  // namespace kvc::backend::cuda

namespace kvc {

/// Knorm on CUDA: one read of K; no workspace.
template <>
struct Kernel<KnormScorer, Cuda> {
  template <class Obs>
  static std::size_t workspace_bytes(Cuda const&, KnormScorer const&, KVExtents const&, Obs const&) {
    return 0;
  }

  template <KVCacheView C, class Obs>
  static Status run(Cuda const& cuda, KnormScorer const&, C const& cache, Obs const&, ScoreSpan<DeviceSpace> out,
                    Workspace) {
    namespace bc = backend::cuda;
    KVExtents const e = cache.keys.extents();
    if (e.batch * e.heads == 0 || e.tokens == 0)
      return {};
    KVC_RETURN_IF_ERROR(
        bc::head_grid_status(e.batch, e.heads, "kvc::score(knorm, Cuda): batch and heads must be <= 65535"));
    KVC_RETURN_IF_ERROR(bc::pending_status());
    dim3 const grid(bc::grid_dim((e.tokens + bc::knorm_warps - 1) / bc::knorm_warps, 4096),
                    static_cast<unsigned>(e.heads), static_cast<unsigned>(e.batch));
    KVC_RETURN_IF_ERROR(bc::launch(KVC_CUDA_KERNEL("kvc::score(knorm, Cuda)", bc::knorm_kernel), grid,
                                   bc::knorm_warps * bc::warp_size, 0, cuda.stream, cache.keys, out));
    return {};
  }
};

}  // namespace kvc
