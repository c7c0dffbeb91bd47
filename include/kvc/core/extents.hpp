// SPDX-License-Identifier: Apache-2.0
// kvc/core/extents.hpp: the index type and the extents of one K or V tensor.
#pragma once

#include <kvc/config.hpp>

#include <cstdint>

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

  /// Number of (batch, head, token) rows.
  KVC_HOST_DEVICE constexpr Index rows() const noexcept { return batch * heads * tokens; }
  friend constexpr bool operator==(KVExtents const&, KVExtents const&) = default;
};

}  // namespace kvc
