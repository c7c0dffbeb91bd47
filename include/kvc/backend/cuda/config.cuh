// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/config.cuh: included first by every CUDA header. Device code only compiles under nvcc with the
// kvc::cuda target linked; host code names kvc::Cuda through <kvc/core/backend.hpp> without any CUDA header.
#pragma once

#if !defined(__CUDACC__)
#  error "kvc/backend/cuda/*.cuh holds device code: include it from a .cu file compiled by nvcc"
#endif
#if !KVC_ENABLE_CUDA
#  error "link the kvc::cuda CMake target (it defines KVC_ENABLE_CUDA=1) before using the CUDA backend"
#endif

#include <kvc/core/backend.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>

#include <cuda_runtime.h>

#include <type_traits>

static_assert(std::is_same_v<cudaStream_t, CUstream_st*>, "kvc::Cuda::stream must be a cudaStream_t");

namespace kvc::backend::cuda {

/// Maps the last launch error to a Status (launches are asynchronous: this catches configuration errors only).
inline Status launch_status(char const* what) noexcept {
  cudaError_t const e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : Status{Errc::backend_error, what};
}

/// Kernels put heads and batch rows on grid y/z, which hold at most 65535 blocks.
inline Status head_grid_status(Index batch, Index heads, char const* what) noexcept {
  return batch > 65535 || heads > 65535 ? Status{Errc::invalid_argument, what} : Status{};
}

/// Threads per warp, and a full-warp mask for shuffles.
inline constexpr int warp_size = 32;
inline constexpr unsigned full_mask = 0xffffffffu;

/// Sum over a warp (every lane gets the result).
template <class T>
__device__ inline T warp_sum(T x) {
  for (int offset = warp_size / 2; offset > 0; offset /= 2)
    x += __shfl_xor_sync(full_mask, x, offset);
  return x;
}

/// Grid dimension from a 64-bit count (kernels loop over any remainder).
inline unsigned grid_dim(Index n, Index cap = 65535) noexcept {
  return static_cast<unsigned>(n < 1 ? 1 : (n > cap ? cap : n));
}

}  // namespace kvc::backend::cuda
