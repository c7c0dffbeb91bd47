// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/compact.hpp: what compaction means, backend-independent checks and the paged-memory report.
//
// Compaction applies a KeepPlan to a cache: for each (b, h), slot j receives the row of token plan.index[j].
// In place, moves go in ascending j and index[j] >= j (the plan is strictly ascending), so a move never
// overwrites a row that a later move still reads. Afterwards head (b, h) holds plan.count[b, h] valid tokens
// in slots [0, count) and plan.index holds their original (RoPE) positions. Kernels: backend/*/pipeline/compact.
#pragma once

#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/status.hpp>

namespace kvc {

/// Checks a host plan against a cache's shape: counts in [0, min(capacity, length(b))], indices strictly
/// ascending inside [0, length(b)). Compaction runs it before moving anything, so a bad plan changes nothing.
template <KVCacheView C>
Status validate_plan(KeepPlan<HostSpace> const& plan, C const& cache) noexcept {
  KVExtents const e = cache.keys.extents();
  if (plan.batch != e.batch || plan.heads != e.heads)
    return {Errc::invalid_argument, "KeepPlan: batch and heads must match the cache"};
  for (Index b = 0; b < plan.batch; ++b) {
    Index const n = cache.length(b);
    for (Index h = 0; h < plan.heads; ++h) {
      Index const count = plan.kept(b, h);
      if (count < 0 || count > plan.capacity || count > n)
        return {Errc::invalid_argument, "KeepPlan: `count` must be in [0, min(capacity, length)]"};
      Index const* idx = plan.indices(b, h);
      for (Index j = 0; j < count; ++j)
        if (idx[j] < 0 || idx[j] >= n || (j > 0 && idx[j] <= idx[j - 1]))
          return {Errc::invalid_argument, "KeepPlan: indices must be strictly ascending and inside [0, length)"};
    }
  }
  return {};
}

/// Page accounting after compacting a paged cache in place. Pages hold every head of a token range (NHD or
/// HND), so a sequence still needs ceil(max_h count / page_size) pages: its tail pages (in page-list order)
/// from that number on can be returned to the engine's allocator.
struct PageReport {
  Index pages_before = 0;  ///< pages the sequences used before (ceil(length / page_size), summed)
  Index pages_after = 0;   ///< pages they need after compaction
  constexpr Index pages_freed() const noexcept { return pages_before - pages_after; }
};

/// Computes the report and, when `pages_in_use` ([batch]) is non-null, each sequence's new page count.
template <KVCacheView C>
PageReport page_report(KeepPlan<HostSpace> const& plan, C const& cache, Index page_size,
                       Index* pages_in_use = nullptr) noexcept {
  PageReport r;
  for (Index b = 0; b < plan.batch; ++b) {
    Index longest = 0;
    for (Index h = 0; h < plan.heads; ++h)
      longest = plan.kept(b, h) > longest ? plan.kept(b, h) : longest;
    Index const after = (longest + page_size - 1) / page_size;
    r.pages_before += (cache.length(b) + page_size - 1) / page_size;
    r.pages_after += after;
    if (pages_in_use)
      pages_in_use[b] = after;
  }
  return r;
}

}  // namespace kvc
