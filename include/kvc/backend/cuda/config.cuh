// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cuda/config.cuh: included first by every CUDA header. Device code only compiles under nvcc with the
// kvc::cuda target linked (or, for kvc's own tests, with the host compiler against the CUDA emulator in
// tools/cuda_emulator, which defines KVC_CUDA_EMULATION=1); host code names kvc::Cuda through <kvc/core/backend.hpp>
// without any CUDA header. Every kernel launch goes through backend::cuda::launch (below).
#pragma once

#if !defined(KVC_CUDA_EMULATION)
#  define KVC_CUDA_EMULATION 0
#endif
#if !defined(__CUDACC__) && !KVC_CUDA_EMULATION
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

/// A quick check with a message naming the parameter that sizes the dynamic shared memory: `bytes` above the
/// device's opt-in per-block limit can never launch. launch() checks the exact sum (static + dynamic) per kernel.
inline Status shared_memory_status(std::size_t bytes, char const* what) noexcept {
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
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

/// The block's dynamic shared memory (the launch's `shared_bytes`), 16-byte aligned, seen as T.
template <class T>
__device__ inline T* dynamic_shared() {
#if KVC_CUDA_EMULATION
  return static_cast<T*>(::kvc::emu::dynamic_shared());
#else
  extern __shared__ __align__(16) unsigned char kvc_dynamic_shared[];
  return reinterpret_cast<T*>(kvc_dynamic_shared);
#endif
}

/// The messages of one launch site, naming the entry point and the kernel (string literals: a Status never
/// allocates). Written by KVC_CUDA_KERNEL.
struct KernelSite {
  char const* name;           ///< "entry point: kernel"
  char const* configuration;  ///< block above the kernel's thread limit, or grid above the device's
  char const* shared_memory;  ///< static + dynamic shared memory above the device's opt-in per-block limit
  char const* failed;         ///< the launch itself failed
};

/// `KVC_CUDA_KERNEL("kvc::score(key_diff, Cuda)", bc::key_diff_anchor_kernel)`: the first two arguments of launch(),
/// the site's messages and the kernel.
#define KVC_CUDA_KERNEL(entry, kernel)                                                                                 \
  ::kvc::backend::cuda::KernelSite{                                                                                    \
      entry ": " #kernel, entry ": " #kernel ": block above the kernel's thread limit, or grid above 65535 in y or z", \
      entry ": " #kernel ": static + dynamic shared memory above the device's per-block limit",                        \
      entry ": " #kernel ": kernel launch failed"},                                                                    \
      kernel

/// launch()'s body: Params are the kernel's parameter types, Args the arguments' (converted as a call converts).
template <class... Params, class... Args>
Status launch_with(KernelSite const& site, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
                   cudaStream_t stream, Args const&... args) noexcept {
  static_assert(sizeof...(Params) == sizeof...(Args), "launch: one argument per kernel parameter");
  cudaFuncAttributes attr{};
  int device = 0, optin_limit = 0;
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    (void)cudaGetLastError();  // ours: pending_status() ran before the entry point launched anything
    return {Errc::backend_error, site.failed};
  }
  unsigned long long const threads = 1ull * block.x * block.y * block.z;
  if (threads == 0 || threads > static_cast<unsigned long long>(attr.maxThreadsPerBlock) || grid.x == 0 ||
      grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
    return {Errc::invalid_argument, site.configuration};
  if (attr.sharedSizeBytes + shared_bytes > static_cast<std::size_t>(optin_limit))
    return {Errc::invalid_argument, site.shared_memory};
  // Above the kernel's current dynamic allowance (48 KiB less its static bytes unless opted in): opt in to all the
  // device allows (the attribute persists, so this happens once per kernel and device).
  if (shared_bytes > static_cast<std::size_t>(attr.maxDynamicSharedSizeBytes) &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           optin_limit - static_cast<int>(attr.sharedSizeBytes)) != cudaSuccess) {
    (void)cudaGetLastError();
    return {Errc::backend_error, site.failed};
  }
#if KVC_CUDA_EMULATION
  // The arguments are copied into the body (a captured launch runs when its graph does); each emulated thread then
  // calls the kernel with its own copy of them, as CUDA passes them by value.
  ::kvc::emu::Launch const config{site.name, reinterpret_cast<void const*>(kernel), grid, block, shared_bytes, stream};
  if (::kvc::emu::launch(config, [kernel, args...] { kernel(args...); }) != cudaSuccess) {
    (void)cudaGetLastError();
    return {Errc::backend_error, site.failed};
  }
  return {};
#else
  // (clang-format would split the closing >>>)
  // clang-format off
  kernel<<<grid, block, shared_bytes, stream>>>(args...);
  // clang-format on
  return cudaGetLastError() == cudaSuccess ? Status{} : Status{Errc::backend_error, site.failed};
#endif
}

/// Launches `kernel<<<grid, block, shared_bytes, stream>>>(args...)`: every kvc launch goes through here. Before
/// launching it checks what would make the launch fail (threads per block against the kernel's own limit, grid y
/// and z <= 65535, static plus dynamic shared memory against the device's opt-in limit, opting the kernel in above
/// the default 48 KiB) and returns a Status naming the kernel; after, it maps the launch error (configuration errors
/// only: kernels run asynchronously). Host calls only (no stream operation), so a step may be captured into a CUDA
/// graph. Under the CUDA emulator the grid runs here, synchronously, and a broken rule is a failed launch.
///
/// `kernel` is a kernel template's name, its template arguments deduced from the arguments' types (which must then
/// be its parameter types), or a specialisation (`kernel<Keys>`) whose parameters the arguments convert to (in
/// parentheses inside KVC_CUDA_KERNEL when its template argument list has a comma).
template <class... Args>
Status launch(KernelSite const& site, void (*kernel)(Args...), dim3 grid, dim3 block, std::size_t shared_bytes,
              cudaStream_t stream, Args const&... args) noexcept {
  return launch_with(site, kernel, grid, block, shared_bytes, stream, args...);
}
template <class... Params, class... Args>
requires(sizeof...(Params) == sizeof...(Args)) Status
    launch(KernelSite const& site, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes,
           cudaStream_t stream, Args const&... args)
noexcept {
  return launch_with(site, kernel, grid, block, shared_bytes, stream, args...);
}

}  // namespace kvc::backend::cuda
