// SPDX-License-Identifier: Apache-2.0
// kvc/core/workspace.hpp: caller-owned scratch memory. Kernels never allocate; they carve what they need from
// a Workspace whose size the caller got from the matching `*_workspace_bytes` query (CUB/CUTLASS two-phase style).
#pragma once

#include <kvc/core/extents.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc {

/// Bytes every carve is aligned to (a cache line; enough for any vector load).
inline constexpr std::size_t workspace_alignment = 64;

/// Bytes a public `*_workspace_bytes` query adds so that any base address works (kernels align every piece).
inline constexpr std::size_t workspace_slack = workspace_alignment;

/// Rounds a byte count up to the workspace alignment.
constexpr std::size_t workspace_round(std::size_t bytes) noexcept {
  return (bytes + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
}

/// A caller-owned byte range in the backend's memory space (host memory for Cpu, device memory for Cuda).
struct Workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

/// Hands out aligned pieces of a Workspace, front to back. Returns nullptr when a non-empty piece does not fit,
/// so a kernel can report Errc::out_of_capacity instead of writing past it (an empty piece never fails).
class WorkspaceCarver {
 public:
  constexpr explicit WorkspaceCarver(Workspace ws) noexcept : ws_(ws) {}

  template <class T>
  T* take(Index count) noexcept {
    auto const base = reinterpret_cast<std::uintptr_t>(ws_.data);
    std::uintptr_t const start = (base + used_ + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
    std::size_t const need = static_cast<std::size_t>(count) * sizeof(T);
    if (count == 0)
      return static_cast<T*>(ws_.data);
    if (ws_.data == nullptr || count < 0 || start - base + need > ws_.bytes)
      return nullptr;
    used_ = static_cast<std::size_t>(start - base) + need;
    return reinterpret_cast<T*>(start);
  }

 private:
  Workspace ws_;
  std::size_t used_ = 0;
};

}  // namespace kvc
