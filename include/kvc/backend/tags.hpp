// SPDX-License-Identifier: Apache-2.0
// kvc/backend/tags.hpp: backend tags and memory spaces. Host-only code can name kvc::Cuda without CUDA headers.
#pragma once

#include <kvc/config.hpp>

#include <type_traits>

struct CUstream_st;  // what cudaStream_t points to; declared here so no CUDA header is needed

namespace kvc {

/// Memory that host code may dereference.
struct HostSpace {};
/// Memory that only device code may dereference (cudaMalloc).
struct DeviceSpace {};

/// The CPU reference backend: the oracle every other backend is tested against.
struct Cpu {
  using memory_space = HostSpace;
};

/// The CUDA backend. Kernels are enqueued on `stream` and never synchronise it.
struct Cuda {
  using memory_space = DeviceSpace;
  CUstream_st* stream = nullptr;  ///< nullptr = the legacy default stream
};

/// A backend is a trivially copyable tag that names the memory space it can read.
template <class B>
concept Backend = std::is_trivially_copyable_v<B> && requires {
  typename B::memory_space;
};

#if KVC_ENABLE_CUDA && defined(__CUDACC__)
using DefaultBackend = Cuda;  ///< for examples only: library entry points always take the backend explicitly
#else
using DefaultBackend = Cpu;
#endif

}  // namespace kvc
