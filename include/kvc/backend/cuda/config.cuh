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
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/status.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

static_assert(std::is_same_v<cudaStream_t, CUstream_st*>, "kvc::Cuda::stream must be a cudaStream_t");

namespace kvc::backend::cuda {

/// Called before kvc enqueues anything: an error the engine left pending (an earlier failed launch) is reported
/// without clearing it and without launching, so kvc neither swallows nor is blamed for someone else's error.
inline Status pending_status() noexcept {
  return cudaPeekAtLastError() == cudaSuccess
             ? Status{}
             : Status{Errc::backend_error,
                      "kvc (CUDA): a CUDA error was already pending before this call; not launched"};
}

/// Maps the last launch error to a Status and clears it (it is ours: pending_status() ran before the launch).
/// Launches are asynchronous: this catches configuration errors only.
inline Status launch_status(char const* what) noexcept {
  cudaError_t const e = cudaGetLastError();
  return e == cudaSuccess ? Status{} : Status{Errc::backend_error, what};
}

/// Kernels put heads and batch rows on grid y/z, which hold at most 65535 blocks.
inline Status head_grid_status(Index batch, Index heads, char const* what) noexcept {
  return batch > 65535 || heads > 65535 ? Status{Errc::invalid_argument, what} : Status{};
}

/// Checks dynamic shared memory against the current device's per-block limit (the default 48 KiB carve-out unless
/// a kernel opts in); `what` names the parameter that sizes it.
inline Status shared_memory_status(std::size_t bytes, char const* what) noexcept {
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlock, device) != cudaSuccess)
    return {Errc::backend_error, "kvc (CUDA): cannot query the device's shared-memory limit"};
  return bytes <= static_cast<std::size_t>(limit) ? Status{} : Status{Errc::invalid_argument, what};
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

/// Max over a warp (every lane gets the result).
__device__ inline float warp_max(float x) {
  for (int offset = warp_size / 2; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(full_mask, x, offset));
  return x;
}

/// Grid dimension from a 64-bit count (kernels loop over any remainder).
inline unsigned grid_dim(Index n, Index cap = 65535) noexcept {
  return static_cast<unsigned>(n < 1 ? 1 : (n > cap ? cap : n));
}

/// A length read on the device, clamped to [0, capacity]: kernels never index past a buffer, whatever the table
/// holds (kvc::validate checks host tables; device tables are the engine's responsibility).
__device__ __host__ inline Index clamp_length(Index n, Index capacity) noexcept {
  return n < 0 ? 0 : (n > capacity ? capacity : n);
}

}  // namespace kvc::backend::cuda
