// SPDX-License-Identifier: Apache-2.0
// kvc/store/pages.hpp: page accounting for compacting paged caches in place: how many pages each sequence (paged
// layout) or head (per-head paged layout) still needs, so that the engine can return the tail pages to its allocator.
#pragma once

#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>

#include <type_traits>

namespace kvc {

/// Page accounting after compacting a paged cache in place. Pages hold every head of a token range (NHD or
/// HND), so a sequence still needs ceil(max_h count / page_size) pages: its tail pages (in page-list order)
/// from that number on can be returned to the engine's allocator.
struct PageReport {
  Index pages_before = 0;  ///< pages the sequences used before (ceil(longest head / page_size), summed)
  Index pages_after = 0;   ///< pages they need after compaction
  constexpr Index pages_freed() const noexcept { return pages_before - pages_after; }
};

/// Computes the report for a host plan over a paged cache (call it before compaction: it reads the lengths the
/// plan was selected on) and, when `pages_in_use` ([batch]) is non-null, each sequence's new page count. Trusts a
/// cache that passed kvc::validate and a plan that passed validate_plan (docs/api_checks.md); a plan of another
/// batch or head count, or a page size <= 0, gives an empty report rather than a read out of bounds.
template <KVCacheView C>
PageReport page_report(KeepPlan<HostSpace> const& plan, C const& cache, Index* pages_in_use = nullptr) noexcept {
  static_assert(std::is_same_v<typename C::keys_type::layout_type, PagedLayout>,
                "kvc::page_report: the cache must have a PagedLayout");
  Index const page_size = cache.keys.layout().page_size;
  PageReport r;
  KVExtents const e = cache.keys.extents();
  if (page_size <= 0 || plan.batch != e.batch || plan.heads != e.heads)
    return r;
  for (Index b = 0; b < plan.batch; ++b) {
    Index kept = 0, before = 0;
    for (Index h = 0; h < plan.heads; ++h) {
      kept = plan.kept(b, h) > kept ? plan.kept(b, h) : kept;
      before = cache.length(b, h) > before ? cache.length(b, h) : before;
    }
    Index const after = (kept + page_size - 1) / page_size;
    r.pages_before += (before + page_size - 1) / page_size;
    r.pages_after += after;
    if (pages_in_use)
      pages_in_use[b] = after;
  }
  return r;
}

/// Page accounting for compacting a per-head paged cache in place: head (b, h) needs ceil(kept / page_size) pages
/// afterwards, so its tail pages (in its page list) from that number on can go back to the engine's allocator.
/// Call it before compaction (it reads the lengths the plan was selected on); `pages_in_use` ([batch, heads],
/// optional) receives each head's new page count.
template <KVCacheView C>
PageReport head_page_report(KeepPlan<HostSpace> const& plan, C const& cache, Index* pages_in_use = nullptr) noexcept {
  static_assert(std::is_same_v<typename C::keys_type::layout_type, HeadPagedLayout>,
                "kvc::head_page_report: the cache must have a HeadPagedLayout");
  Index const ps = cache.keys.layout().page_size;
  KVExtents const e = cache.keys.extents();
  PageReport r;
  if (ps <= 0 || plan.batch != e.batch || plan.heads != e.heads)
    return r;
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      Index const after = (plan.kept(b, h) + ps - 1) / ps;
      r.pages_before += (cache.length(b, h) + ps - 1) / ps;
      r.pages_after += after;
      if (pages_in_use)
        pages_in_use[b * e.heads + h] = after;
    }
  return r;
}

}  // namespace kvc
