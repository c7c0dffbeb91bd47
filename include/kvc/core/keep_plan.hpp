// SPDX-License-Identifier: Apache-2.0
// kvc/core/keep_plan.hpp: the output of selection: which tokens each (batch, KV head) keeps.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/extents.hpp>

namespace kvc {

/// Kept token indices per (b, h), **strictly ascending**, `count[b * heads + h]` of them, in caller-owned
/// fixed-capacity storage (shapes never depend on the data, so CUDA graphs can capture selection).
/// `index` is [batch, heads, capacity]; slots past the count are left untouched. Indices are cache slots of the
/// cache the plan was selected on: after compaction, slot j holds what slot `index[j]` held (its absolute position
/// travels in the cache's `positions`, not in the plan).
template <class Space = HostSpace>
struct KeepPlan {
  using memory_space = Space;

  Index* index = nullptr;
  Index* count = nullptr;
  Index batch = 0;
  Index heads = 0;
  Index capacity = 0;

  KVC_HOST_DEVICE constexpr Index* indices(Index b, Index h) const noexcept {
    return index + (b * heads + h) * capacity;
  }
  KVC_HOST_DEVICE constexpr Index& kept(Index b, Index h) const noexcept { return count[b * heads + h]; }
};

}  // namespace kvc
