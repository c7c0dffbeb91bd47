// SPDX-License-Identifier: Apache-2.0
// kvc/rate_distortion/bit_plan.hpp: an RDKV layer's bit plan (docs/policies/rdkv.md): a bit width per V token and per K
// channel of every (sequence, KV head), each from {0, 2, 4, 8, 16}. The allocator (selectors/rdkv.hpp) writes it, the
// packer (pipeline/pack.hpp) reads it. Its own header so that both can include it without including each other.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/extents.hpp>

#include <cstdint>

namespace kvc {

/// Bit plan of a layer, in memory space `Space`:
///   v_bits [batch, heads, tokens] int8: bits of each token's V (0 = evicted from K and V; padding slots 0);
///   k_bits [batch, heads, dim] int8: bits of each K channel over the head's kept tokens (0 = channel pruned).
/// Every entry is 0, 2, 4, 8 or 16 (16 = lossless FP16).
template <class Space = HostSpace>
struct BitPlan {
  using memory_space = Space;

  std::int8_t* v_bits = nullptr;
  std::int8_t* k_bits = nullptr;
  Index batch = 0;
  Index heads = 0;
  Index tokens = 0;
  Index dim = 0;

  KVC_HOST_DEVICE constexpr std::int8_t* v_row(Index b, Index h) const noexcept {
    return v_bits + (b * heads + h) * tokens;
  }
  KVC_HOST_DEVICE constexpr std::int8_t* k_row(Index b, Index h) const noexcept {
    return k_bits + (b * heads + h) * dim;
  }
};

/// Whether `bits` is one of the bit widths a plan may hold: 0, 2, 4, 8, 16.
KVC_HOST_DEVICE constexpr bool valid_bits(int bits) noexcept {
  return bits == 0 || bits == 2 || bits == 4 || bits == 8 || bits == 16;
}

}  // namespace kvc
