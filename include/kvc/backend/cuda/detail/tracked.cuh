// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/detail/tracked.cuh: the `tracked` table of the stateful scorers (H2O, UNComp, MomentKV's u_j
// cache) set to each head's length after an update, shared by their kernels.
#pragma once

#include <kvc/backend/cuda/config.cuh>

namespace kvc::backend::cuda {

/// tracked[b, h] = the head's (clamped) length: every valid slot now holds the state the update wrote.
template <class C>
__global__ void track_lengths_kernel(C cache, Index* tracked) {
  KVExtents const e = cache.keys.extents();
  Index const i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < e.batch * e.heads)
    tracked[i] = cache.clamped_length(i / e.heads, i % e.heads);
}

/// Threads per block of track_lengths_kernel (one thread per head).
inline constexpr int track_threads = 256;

}  // namespace kvc::backend::cuda
