// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/detail/block_reduce.cuh: block-wide max, sum and exclusive prefix sum of one value per thread, in
// a fixed order (the warp shuffle tree, then one value per warp in shared memory), so results do not depend on
// scheduling. kvc's own (not CUB's): the same code runs on the device and under the CUDA emulator.
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

/// Block-wide sum of one value per thread, same shape and order rules as block_max (deterministic); `scratch` holds
/// 32 values of T.
template <class T>
__device__ inline T block_sum(T x, T* scratch) {
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  x = warp_sum(x);
  if (lane == 0)
    scratch[warp] = x;
  __syncthreads();
  int const warps = static_cast<int>(blockDim.x) / warp_size;
  x = lane < warps ? scratch[lane] : T{};
  x = warp_sum(x);
  __syncthreads();
  return x;
}

/// Inclusive prefix sum over the lanes of a warp (lane i gets x_0 + ... + x_i).
__device__ inline int warp_inclusive_sum(int x) {
  int const lane = static_cast<int>(threadIdx.x) % warp_size;
  for (int d = 1; d < warp_size; d *= 2) {
    int const y = __shfl_up_sync(full_mask, x, static_cast<unsigned>(d));
    if (lane >= d)
      x += y;
  }
  return x;
}

/// Block-wide exclusive prefix sum of one int per thread in thread order; `total` gets the block's sum (every
/// thread). Same shape rules as block_max; `scratch` holds 32 ints. Ends with a barrier, so the caller may reuse
/// `scratch` (and read anything written before the call) at once.
__device__ inline int block_exclusive_sum(int x, int& total, int* scratch) {
  int const warp = static_cast<int>(threadIdx.x) / warp_size, lane = static_cast<int>(threadIdx.x) % warp_size;
  int const warps = static_cast<int>(blockDim.x) / warp_size;
  int const inclusive = warp_inclusive_sum(x);
  if (lane == warp_size - 1)
    scratch[warp] = inclusive;
  __syncthreads();
  int const warp_total = lane < warps ? scratch[lane] : 0;
  int const warps_inclusive = warp_inclusive_sum(warp_total);  // lane w: the totals of warps 0..w
  int const before = __shfl_sync(full_mask, warps_inclusive - warp_total, warp);
  total = __shfl_sync(full_mask, warps_inclusive, warps - 1);
  __syncthreads();
  return before + inclusive - x;
}

}  // namespace kvc::backend::cuda
