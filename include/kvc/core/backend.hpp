// SPDX-License-Identifier: Apache-2.0
// kvc/core/backend.hpp: backend tags and memory spaces. Host-only code can name kvc::Cuda without CUDA headers.
#pragma once

#include <kvc/core/extents.hpp>

#include <concepts>
#include <type_traits>

struct CUstream_st;  // what cudaStream_t points to; declared here so no CUDA header is needed

namespace kvc {

/// Memory that host code may dereference.
struct HostSpace {};
/// Memory that only device code may dereference (cudaMalloc).
struct DeviceSpace {};

/// A parallel-for the engine supplies (engines own their thread pools). `run(context, n, task)` must call
/// `task.fn(task.context, item, worker)` exactly once for every item in [0, n), with `worker` in [0, workers)
/// and no two concurrent calls sharing a worker index, and return when all calls have returned.
/// Kernels give each (sequence, head) item its own outputs and each worker its own scratch, so results are
/// bit-identical whatever the thread count. The default (run == nullptr) is serial.
struct ParallelFor {
  struct Task {
    void* context;
    void (*fn)(void* context, Index item, Index worker);
  };
  void* context = nullptr;
  void (*run)(void* context, Index n, Task task) = nullptr;
  Index workers = 1;  ///< scratch copies kernels carve from the workspace (>= 1)
};

/// The CPU reference backend: the oracle every other backend is tested against. Serial unless `parallel` is set
/// (see kvc::ThreadPool in <kvc/backend/cpu/thread_pool.hpp> for a small std::thread one).
struct Cpu {
  using memory_space = HostSpace;
  ParallelFor parallel{};

  /// Scratch copies a kernel needs: one per worker.
  constexpr Index workers() const noexcept { return parallel.run && parallel.workers > 1 ? parallel.workers : 1; }
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

/// Whether a view or parameter block `T` (anything with a `memory_space`) can be read by backend B.
template <class T, class B>
concept ReadableBy = Backend<B> && std::same_as<typename T::memory_space, typename B::memory_space>;

}  // namespace kvc
