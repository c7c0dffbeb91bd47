// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/pipeline/compact.hpp: CPU kernels of compaction (in place), gather (into other buffers) and append.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/pipeline/compact.hpp>

#include <algorithm>
#include <type_traits>

namespace kvc {

namespace detail {

/// Row t of head (b, h) of `src` into row `at` of `dst` (core/access.hpp's copy_elements: bytes when the types and
/// scales match).
template <class DstRows, class SrcRows>
inline void copy_row(DstRows const& dst, Index at, SrcRows const& src, Index t, Index b, Index h) noexcept {
  copy_elements(dst.row(b, h, at), dst.scale(b, h), src.row(b, h, t), src.scale(b, h), dst.extents().dim);
}

/// Checks that a per-sequence table can record `count(b, h)` (every head of a sequence equal); per-head or absent
/// tables always can.
template <class Count>
Status lengths_representable(Lengths const& lengths, Index batch, Index heads, Count&& count, char const* what) {
  if (lengths.data == nullptr || lengths.per_head())
    return {};
  for (Index b = 0; b < batch; ++b)
    for (Index h = 1; h < heads; ++h)
      if (count(b, h) != count(b, 0))
        return {Errc::invalid_argument, what};
  return {};
}

/// Writes new per-head lengths into a table (per sequence: head 0's, all heads being equal).
template <class Count>
void write_lengths(Lengths const& lengths, Index batch, Index heads, Count&& count) {
  if (lengths.data == nullptr)
    return;
  for (Index b = 0; b < batch; ++b)
    for (Index h = 0; h < (lengths.per_head() ? heads : 1); ++h)
      lengths.data[lengths.per_head() ? b * heads + h : b] = count(b, h);
}

/// Moves slot `from` of an extra per-token array to slot `to`: a scalar (TokenArray) or a row (TokenRows; a view
/// with a null data pointer is an absent array and is skipped).
template <class T>
void move_token(TokenArray<T, HostSpace> const& a, Index b, Index h, Index from, Index to) noexcept {
  a(b, h, to) = a(b, h, from);
}
template <class T, class L>
void move_token(TokenRows<T, L, HostSpace> const& a, Index b, Index h, Index from, Index to) noexcept {
  if (a.data() != nullptr)
    std::copy_n(a.row(b, h, from), a.extents().dim, a.row(b, h, to));
}

}  // namespace detail

template <>
struct Kernel<CompactStep, Cpu> {
  template <KVCacheView C, class... Extra>
  static Status run(Cpu const& cpu, KeepPlan<HostSpace> const& plan, C const& cache, Extra const&... extra) {
    KVC_RETURN_IF_ERROR(validate_plan(plan, cache));
    KVC_RETURN_IF_ERROR(detail::lengths_representable(
        cache.lengths, plan.batch, plan.heads, [&](Index b, Index h) { return plan.kept(b, h); },
        "kvc::compact: heads of one sequence keep different counts; give the cache a per-head length table"));
    Index const dk = cache.keys.extents().dim, dv = cache.values.extents().dim;
    detail::parallel_for(cpu, plan.batch * plan.heads, [&](Index item, Index) {
      Index const b = item / plan.heads, h = item % plan.heads;
      Index const* idx = plan.indices(b, h);
      for (Index j = 0; j < plan.kept(b, h); ++j) {  // ascending j, idx[j] >= j: never overtakes a source
        if (idx[j] == j)
          continue;
        std::copy_n(cache.keys.row(b, h, idx[j]), dk, cache.keys.row(b, h, j));
        std::copy_n(cache.values.row(b, h, idx[j]), dv, cache.values.row(b, h, j));
        if (cache.positions)
          cache.position_ref(b, h, j) = cache.position_ref(b, h, idx[j]);
        (detail::move_token(extra, b, h, idx[j], j), ...);
      }
    });
    detail::write_lengths(cache.lengths, plan.batch, plan.heads, [&](Index b, Index h) { return plan.kept(b, h); });
    return {};
  }
};

template <>
struct Kernel<GatherStep, Cpu> {
  template <KVCacheView Src, KVCacheView Dst, class... Carried>
  static Status run(Cpu const& cpu, KeepPlan<HostSpace> const& plan, Src const& src, Dst const& dst,
                    Carried const&... carried) {
    KVC_RETURN_IF_ERROR(validate_plan(plan, src));
    for (Index b = 0; b < plan.batch; ++b)
      for (Index h = 0; h < plan.heads; ++h)
        if (plan.kept(b, h) > dst.capacity(b, h))
          return {Errc::out_of_capacity, "kvc::gather: a head of `dst` has fewer token slots than it keeps"};
    KVC_RETURN_IF_ERROR(detail::lengths_representable(
        dst.lengths, plan.batch, plan.heads, [&](Index b, Index h) { return plan.kept(b, h); },
        "kvc::gather: heads of one sequence keep different counts; give `dst` a per-head length table"));
    detail::parallel_for(cpu, plan.batch * plan.heads, [&](Index item, Index) {
      Index const b = item / plan.heads, h = item % plan.heads;
      Index const* idx = plan.indices(b, h);
      for (Index j = 0; j < plan.kept(b, h); ++j) {
        detail::copy_row(dst.keys, j, src.keys, idx[j], b, h);
        detail::copy_row(dst.values, j, src.values, idx[j], b, h);
        if (dst.positions)
          dst.position_ref(b, h, j) = src.position(b, h, idx[j]);
        ((carried.to(b, h, j) = carried.from(b, h, idx[j])), ...);
      }
    });
    detail::write_lengths(dst.lengths, plan.batch, plan.heads, [&](Index b, Index h) { return plan.kept(b, h); });
    return {};
  }
};

template <>
struct Kernel<AppendStep, Cpu> {
  template <KVCacheView Dst, KVCacheView Src>
  static Status run(Cpu const& cpu, Dst const& dst, Src const& src, Index begin, Index count) {
    KVExtents const de = dst.keys.extents(), se = src.keys.extents();
    KVC_RETURN_IF_ERROR(detail::check_lengths(dst.lengths, de.batch, de.heads, de.tokens,
                                              "kvc::append: every valid length of `dst` must be in [0, tokens]"));
    KVC_RETURN_IF_ERROR(detail::check_lengths(src.lengths, se.batch, se.heads, se.tokens,
                                              "kvc::append: every valid length of `src` must be in [0, tokens]"));
    auto added = [&](Index b, Index h) {  // tokens head (b, h) receives
      Index const left = src.length(b, h) - begin;
      return left <= 0 ? Index{0} : (left < count ? left : count);
    };
    for (Index b = 0; b < de.batch; ++b)
      for (Index h = 0; h < de.heads; ++h)
        if (dst.length(b, h) + added(b, h) > dst.capacity(b, h))
          return {Errc::out_of_capacity, "kvc::append: a head of `dst` would pass its capacity (its slots)"};
    KVC_RETURN_IF_ERROR(detail::lengths_representable(
        dst.lengths, de.batch, de.heads, added,
        "kvc::append: heads of one sequence receive different counts; give `dst` a per-head length table"));
    detail::parallel_for(cpu, de.batch * de.heads, [&](Index item, Index) {
      Index const b = item / de.heads, h = item % de.heads, at = dst.length(b, h);
      for (Index j = 0; j < added(b, h); ++j) {
        detail::copy_row(dst.keys, at + j, src.keys, begin + j, b, h);
        detail::copy_row(dst.values, at + j, src.values, begin + j, b, h);
        if (dst.positions)
          dst.position_ref(b, h, at + j) = src.position(b, h, begin + j);
      }
    });
    detail::write_lengths(dst.lengths, de.batch, de.heads,
                          [&](Index b, Index h) { return dst.length(b, h) + added(b, h); });
    return {};
  }
};

}  // namespace kvc
