// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/detail/block_reduce.cuh: block-wide max and sum of one float per thread, in a fixed order (the
// warp shuffle tree, then one value per warp in shared memory), so results do not depend on scheduling.
#pragma once

#include <kvc/backend/cuda/config.cuh>

#include <math_constants.h>

namespace kvc::backend::cuda {

/// Block-wide max of one value per thread (blockDim.x a multiple of 32, at most 1024; `scratch` holds 32 floats).
/// NaN never wins (fmaxf). Every thread gets the result; call it block-uniformly.
__device__ inline float block_max(float x, float* scratch) {
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  x = warp_max(x);
  if (lane == 0)
    scratch[warp] = x;
  __syncthreads();
  int const warps = static_cast<int>(blockDim.x) / warp_size;
  x = lane < warps ? scratch[lane] : -CUDART_INF_F;
  x = warp_max(x);
  __syncthreads();
  return x;
}

/// Block-wide sum of one value per thread, same shape and order rules as block_max (deterministic).
__device__ inline float block_sum(float x, float* scratch) {
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  x = warp_sum(x);
  if (lane == 0)
    scratch[warp] = x;
  __syncthreads();
  int const warps = static_cast<int>(blockDim.x) / warp_size;
  x = lane < warps ? scratch[lane] : 0.0f;
  x = warp_sum(x);
  __syncthreads();
  return x;
}

}  // namespace kvc::backend::cuda
