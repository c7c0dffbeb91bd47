// SPDX-License-Identifier: Apache-2.0
// kvc/core/extents.hpp: the index type and the extents of one K or V tensor.
#pragma once

#include <kvc/config.hpp>

#include <concepts>
#include <cstdint>
#include <limits>

namespace kvc {

/// Every size, offset and token index is 64-bit: a 128K-token, 64-head, 128-dim cache already has 2^30 elements.
using Index = std::int64_t;

/// Extents of one K or V tensor: [batch, heads, tokens, dim]. `heads` are KV heads; `tokens` is the capacity
/// per sequence (ragged batches carry their valid lengths separately, see KVCache::lengths). `dim` is the head
/// dimension and is always unit-stride.
struct KVExtents {
  Index batch = 0;
  Index heads = 0;
  Index tokens = 0;
  Index dim = 0;

  /// Number of (batch, head, token) rows. Only for extents known to fit (kvc::extents_fit): it does not check.
  KVC_HOST_DEVICE constexpr Index rows() const noexcept { return batch * heads * tokens; }
  friend constexpr bool operator==(KVExtents const&, KVExtents const&) = default;
};

/// r = first * rest...; false when a partial product does not fit in Index (r is then unspecified). The one
/// overflow-checked product of sizes: layouts, kvc::validate and entry points call it before they multiply extents
/// that came from a caller, since a signed overflow is undefined behaviour, not a wrong number.
template <std::same_as<Index>... I>
constexpr bool checked_product(Index& r, Index first, I... rest) noexcept {
  r = first;
  return (!__builtin_mul_overflow(r, rest, &r) && ...);
}

/// The product, or the largest Index when it overflows. For layout constructors, which cannot return a Status: a
/// stride of extents whose element count overflows saturates instead of overflowing, and kvc::validate and every
/// entry point reject such extents (extents_fit) before any offset is computed from it.
template <std::same_as<Index>... I>
constexpr Index saturating_product(Index first, I... rest) noexcept {
  Index r = 0;
  return checked_product(r, first, rest...) ? r : std::numeric_limits<Index>::max();
}

/// Whether extents describe a tensor: batch, heads, tokens >= 0, dim > 0 and batch * heads * tokens * dim elements
/// fit in Index (so every rows() and element count of it can be computed without overflow).
constexpr bool extents_fit(KVExtents const& e) noexcept {
  Index n = 0;
  return e.batch >= 0 && e.heads >= 0 && e.tokens >= 0 && e.dim > 0 &&
         checked_product(n, e.batch, e.heads, e.tokens, e.dim);
}

}  // namespace kvc
