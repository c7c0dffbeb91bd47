// SPDX-License-Identifier: Apache-2.0
// kvc/core/workspace.hpp: caller-owned scratch memory. Kernels never allocate; they carve what they need from
// a Workspace whose size the caller got from the matching `*_workspace_bytes` query (CUB/CUTLASS two-phase style).
#pragma once

#include <kvc/core/extents.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kvc {

/// Bytes every carve is aligned to (a cache line; enough for any vector load).
inline constexpr std::size_t workspace_alignment = 64;

/// Bytes a public `*_workspace_bytes` query adds so that any base address works (kernels align every piece).
inline constexpr std::size_t workspace_slack = workspace_alignment;

/// Byte counts of workspace queries saturate at SIZE_MAX instead of wrapping: extents that come from requests can
/// make a query ask for more than any allocation gives (the entry point then reports out_of_capacity), never for a
/// small size that a kernel would overrun. A negative factor (an invalid extent) saturates too.
inline constexpr std::size_t saturated_bytes = SIZE_MAX;

namespace detail {
template <class T>
constexpr bool is_negative(T x) noexcept {
  if constexpr (std::is_signed_v<T>)
    return x < 0;
  else
    return false;
}
}  // namespace detail

/// The product of the factors, or saturated_bytes when it does not fit (or a factor is negative).
template <class... T>
constexpr std::size_t bytes_product(T... factors) noexcept {
  std::size_t r = 1;
  bool overflow = false;
  ((overflow =
        overflow || detail::is_negative(factors) || __builtin_mul_overflow(r, static_cast<std::size_t>(factors), &r)),
   ...);
  return overflow ? saturated_bytes : r;
}

/// The sum of the terms, or saturated_bytes when it does not fit.
template <class... T>
constexpr std::size_t bytes_sum(T... terms) noexcept {
  std::size_t r = 0;
  bool overflow = false;
  ((overflow = overflow || __builtin_add_overflow(r, static_cast<std::size_t>(terms), &r)), ...);
  return overflow ? saturated_bytes : r;
}

/// Rounds a byte count up to the workspace alignment (saturated_bytes stays saturated).
constexpr std::size_t workspace_round(std::size_t bytes) noexcept {
  return bytes > saturated_bytes - workspace_alignment
             ? saturated_bytes
             : (bytes + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
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
    if (count == 0)
      return static_cast<T*>(ws_.data);
    if (ws_.data == nullptr || count < 0 || start - base > ws_.bytes ||
        static_cast<std::size_t>(count) > (ws_.bytes - (start - base)) / sizeof(T))  // no product that can wrap
      return nullptr;
    std::size_t const need = static_cast<std::size_t>(count) * sizeof(T);
    used_ = static_cast<std::size_t>(start - base) + need;
    return reinterpret_cast<T*>(start);
  }

  /// The unused remainder from the next aligned address on (for a callee that carves its own pieces).
  Workspace rest() const noexcept {
    auto const base = reinterpret_cast<std::uintptr_t>(ws_.data);
    std::uintptr_t const start = (base + used_ + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
    if (ws_.data == nullptr || start - base > ws_.bytes)
      return {};
    return {reinterpret_cast<void*>(start), ws_.bytes - static_cast<std::size_t>(start - base)};
  }

 private:
  Workspace ws_;
  std::size_t used_ = 0;
};

}  // namespace kvc
