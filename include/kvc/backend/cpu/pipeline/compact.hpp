// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/pipeline/compact.hpp: CPU compaction (in place) and gather (into other buffers).
#pragma once

#include <kvc/pipeline/compact.hpp>

#include <algorithm>
#include <type_traits>

namespace kvc {

namespace detail {

template <class Dst, class Src>
inline void copy_row(Dst* dst, Src const* src, Index dim) noexcept {
  if constexpr (std::is_same_v<std::remove_const_t<Src>, Dst>)
    std::copy_n(src, dim, dst);
  else
    for (Index i = 0; i < dim; ++i)
      dst[i] = from_float<Dst>(to_float(src[i]));
}

}  // namespace detail

/// Compacts `cache` in place (any layout: dense, strided or paged inside the sequence's own pages).
/// Keys and values move together. A plan that fails validate_plan() is rejected before anything moves.
template <KVCacheView C>
Status compact(Cpu const&, KeepPlan<HostSpace> const& plan, C const& cache) {
  static_assert(AccessibleFrom<C, Cpu>, "kvc::compact(Cpu): the cache must live in host memory");
  static_assert(!std::is_const_v<typename decltype(cache.keys)::element_type> &&
                    !std::is_const_v<typename decltype(cache.values)::element_type>,
                "kvc::compact: in-place compaction needs writable K and V views");
  KVC_RETURN_IF_ERROR(validate_plan(plan, cache));
  Index const dk = cache.keys.extents().dim, dv = cache.values.extents().dim;
  for (Index b = 0; b < plan.batch; ++b)
    for (Index h = 0; h < plan.heads; ++h) {
      Index const* idx = plan.indices(b, h);
      for (Index j = 0; j < plan.kept(b, h); ++j) {  // ascending j, idx[j] >= j: never overtakes a source
        if (idx[j] == j)
          continue;
        std::copy_n(cache.keys.row(b, h, idx[j]), dk, cache.keys.row(b, h, j));
        std::copy_n(cache.values.row(b, h, idx[j]), dv, cache.values.row(b, h, j));
      }
    }
  return {};
}

/// Copies the kept rows of `src` into slots [0, count) of `dst` (another cache with capacity for the largest
/// count; element types may differ, converting with round-to-nearest-even). `src` is not modified.
template <KVCacheView Src, KVCacheView Dst>
Status gather(Cpu const&, KeepPlan<HostSpace> const& plan, Src const& src, Dst const& dst) {
  static_assert(AccessibleFrom<Src, Cpu> && AccessibleFrom<Dst, Cpu>,
                "kvc::gather(Cpu): caches must be in host memory");
  KVC_RETURN_IF_ERROR(validate_plan(plan, src));
  KVExtents const sk = src.keys.extents(), dk = dst.keys.extents();
  if (dk.batch != sk.batch || dk.heads != sk.heads || dk.dim != sk.dim ||
      dst.values.extents().dim != src.values.extents().dim)
    return {Errc::invalid_argument, "kvc::gather: `dst` must have the batch, heads and dims of `src`"};
  for (Index b = 0; b < plan.batch; ++b)
    for (Index h = 0; h < plan.heads; ++h)
      if (plan.kept(b, h) > dk.tokens || plan.kept(b, h) > dst.values.extents().tokens)
        return {Errc::out_of_capacity, "kvc::gather: `dst` has fewer token slots than a head keeps"};
  for (Index b = 0; b < plan.batch; ++b)
    for (Index h = 0; h < plan.heads; ++h) {
      Index const* idx = plan.indices(b, h);
      for (Index j = 0; j < plan.kept(b, h); ++j) {
        detail::copy_row(dst.keys.row(b, h, j), src.keys.row(b, h, idx[j]), dk.dim);
        detail::copy_row(dst.values.row(b, h, j), src.values.row(b, h, idx[j]), dst.values.extents().dim);
      }
    }
  return {};
}

}  // namespace kvc
