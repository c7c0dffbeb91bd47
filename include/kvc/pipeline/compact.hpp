// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/compact.hpp: applying a KeepPlan to a cache (compact in place, gather elsewhere), appending new
// tokens; the paged-memory report is in store/pages.hpp. Kernels: Kernel<CompactStep / GatherStep / AppendStep, B> in
// backend/*/pipeline/compact.
//
// Compaction: for each (b, h), slot j receives what slot plan.index[j] held: K and V rows, the position, and every
// extra per-token array passed along (e.g. a stateful scorer's accumulator). In place, moves go in ascending j and
// index[j] >= j (the plan is strictly ascending), so a move never overwrites a row that a later move still reads.
// Afterwards head (b, h) holds plan.count[b, h] valid tokens in slots [0, count): compaction writes them into the
// cache's length table (per head: every count; per sequence: the heads' common count; no table: read plan.count).
// A per-sequence table cannot record heads of one sequence that keep different counts: the CPU reports it as
// invalid_argument before moving anything; the CUDA kernels cannot check it without a synchronisation and write
// head 0's count, so it is a precondition there: give caches whose heads may differ a per-head table.
// New tokens then go after each head's length: kvc::append.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/status.hpp>
#include <kvc/store/pages.hpp>  // the paged-memory report (kvc::page_report), with the rest of compaction's API

#include <type_traits>

namespace kvc {

/// Step tags of the kernel pattern (core/kernel.hpp).
struct CompactStep {};
struct GatherStep {};
struct AppendStep {};

/// A per-token array carried from a source cache to a destination cache by kvc::gather.
template <class T, class Space = HostSpace>
struct CarriedArray {
  using memory_space = Space;
  TokenArray<T const, Space> from;
  TokenArray<T, Space> to;
};

namespace detail {
template <class A>
inline constexpr bool is_token_array = false;
template <class T, class S>
inline constexpr bool is_token_array<TokenArray<T, S>> = !std::is_const_v<T>;
template <class T, class L, class S, class A>
inline constexpr bool is_token_array<TokenRows<T, L, S, A>> = !std::is_const_v<T>;  // per-token rows (MomentKV's u_j)
template <class A>
inline constexpr bool is_carried_array = false;
template <class T, class S>
inline constexpr bool is_carried_array<CarriedArray<T, S>> = true;
}  // namespace detail

namespace detail {
template <class T, class S>
constexpr bool extra_mismatch(TokenArray<T, S> const& a, KVExtents const& e) noexcept {
  Index n = 0;
  return a.batch != e.batch || a.heads != e.heads || a.tokens < e.tokens ||
         !checked_product(n, a.batch, a.heads, a.tokens) || (a.data == nullptr && n > 0);
}
template <class T, class L, class S, class A>
constexpr bool extra_mismatch(TokenRows<T, L, S, A> const& a, KVExtents const& e) noexcept {
  KVExtents const x = a.extents();
  return a.data() != nullptr && (x.batch != e.batch || x.heads != e.heads || x.tokens < e.tokens || !extents_fit(x));
}

/// The bytes of a per-token array: [batch, heads, tokens] scalars, or a view's rows (none for a null view).
template <class T, class S>
ByteRange bytes_of(TokenArray<T, S> const& a) noexcept {
  return bytes_of(a.data, saturating_product(a.batch, a.heads, a.tokens));
}
}  // namespace detail

/// Compacts `cache` in place (any layout: dense, strided or paged inside the sequence's own pages), with its
/// positions, its length table and every extra per-token array [batch, heads, tokens] in `extra` (writable
/// TokenArrays in the cache's memory space, or TokenRows of per-token rows; a TokenRows with null data is skipped). The
/// CPU rejects a plan that fails validate_plan() before moving anything; the CUDA kernels trust a plan produced by
/// kvc::select.
template <Backend B, KVCacheView C, class... Extra>
Status compact(B const& backend, KeepPlan<typename B::memory_space> const& plan, C const& cache,
               Extra const&... extra) {
  static_assert(AccessibleFrom<C, B>, "kvc::compact: the cache lives in a memory space this backend cannot read");
  static_assert(
      !std::is_const_v<typename C::keys_type::element_type> && !std::is_const_v<typename C::values_type::element_type>,
      "kvc::compact: in-place compaction needs writable K and V views");
  static_assert((detail::is_token_array<Extra> && ...) && (ReadableBy<Extra, B> && ...),
                "kvc::compact: extra arrays must be writable kvc::TokenArray views in the backend's memory space");
  static_assert(HasKernel<CompactStep, B>,
                "kvc::compact: include <kvc/backend/cpu/pipeline/compact.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/pipeline/compact.cuh> (kvc::Cuda)");
  KVExtents const e = cache.keys.extents();
  KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::compact", "the cache")));
  if (plan.batch != e.batch || plan.heads != e.heads || plan.capacity < 0)
    return {Errc::invalid_argument, "kvc::compact: `plan` must have the cache's batch and heads (capacity >= 0)"};
  if ((plan.index == nullptr || plan.count == nullptr) && e.batch * e.heads > 0)
    return {Errc::invalid_argument, "kvc::compact: `plan.index` and `plan.count` must not be null"};
  if ((detail::extra_mismatch(extra, e) || ...))
    return {Errc::invalid_argument,
            "kvc::compact: every extra array must be [batch, heads, >= tokens] of the cache, non-null"};
  // The cache is written in place while the plan and the extras are read or written beside it.
  if (detail::overlaps_cache(detail::bytes_of(plan), cache))
    return {Errc::invalid_argument, "kvc::compact: `plan` overlaps the cache's keys or values"};
  if ((detail::overlaps_cache(detail::bytes_of(extra), cache) || ...))
    return {Errc::invalid_argument, "kvc::compact: an extra array overlaps the cache's keys or values"};
  return Kernel<CompactStep, B>::run(backend, plan, cache, extra...);
}

/// Copies the kept rows of `src` into slots [0, count) of `dst` (another cache with capacity for the largest
/// count; element types may differ, converting with round-to-nearest-even), with positions (when `dst` has a
/// positions table: src's positions, or src's slot numbers when src has none) and `carried` arrays. dst's length
/// table is written like compaction's (same per-sequence precondition on CUDA). `src` is not modified.
template <Backend B, KVCacheView Src, KVCacheView Dst, class... Carried>
Status gather(B const& backend, KeepPlan<typename B::memory_space> const& plan, Src const& src, Dst const& dst,
              Carried const&... carried) {
  static_assert(AccessibleFrom<Src, B> && AccessibleFrom<Dst, B>,
                "kvc::gather: the caches live in a memory space this backend cannot read");
  static_assert((detail::is_carried_array<Carried> && ...) && (ReadableBy<Carried, B> && ...),
                "kvc::gather: carried arrays must be kvc::CarriedArray views in the backend's memory space");
  static_assert(HasKernel<GatherStep, B>,
                "kvc::gather: include <kvc/backend/cpu/pipeline/compact.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/pipeline/compact.cuh> (kvc::Cuda)");
  KVExtents const sk = src.keys.extents(), dk = dst.keys.extents();
  KVC_RETURN_IF_ERROR(detail::check_cache(src, KVC_CACHE_MESSAGES("kvc::gather", "`src`")));
  KVC_RETURN_IF_ERROR(detail::check_cache(dst, KVC_CACHE_MESSAGES("kvc::gather", "`dst`")));
  if (plan.batch != sk.batch || plan.heads != sk.heads || plan.capacity < 0)
    return {Errc::invalid_argument, "kvc::gather: `plan` must have the source cache's batch and heads"};
  if ((plan.index == nullptr || plan.count == nullptr) && sk.batch * sk.heads > 0)
    return {Errc::invalid_argument, "kvc::gather: `plan.index` and `plan.count` must not be null"};
  if (dk.batch != sk.batch || dk.heads != sk.heads || dk.dim != sk.dim ||
      dst.values.extents().dim != src.values.extents().dim)
    return {Errc::invalid_argument, "kvc::gather: `dst` must have the batch, heads and dims of `src`"};
  if (((detail::extra_mismatch(carried.from, sk) || detail::extra_mismatch(carried.to, dk)) || ...))
    return {Errc::invalid_argument,
            "kvc::gather: carried arrays must be [batch, heads, >= tokens] of their caches, non-null"};
  // dst is written while src, the plan and the carried sources are read.
  if (detail::overlaps_cache(detail::bytes_of(dst.keys), src) ||
      detail::overlaps_cache(detail::bytes_of(dst.values), src))
    return {Errc::invalid_argument, "kvc::gather: `dst` overlaps `src`'s keys or values"};
  if (detail::overlaps_cache(detail::bytes_of(plan), dst))
    return {Errc::invalid_argument, "kvc::gather: `plan` overlaps `dst`'s keys or values"};
  if (((detail::overlaps_cache(detail::bytes_of(carried.to), src) ||
        detail::overlaps_cache(detail::bytes_of(carried.to), dst)) ||
       ...))
    return {Errc::invalid_argument, "kvc::gather: a carried array's `to` overlaps the keys or values of a cache"};
  return Kernel<GatherStep, B>::run(backend, plan, src, dst, carried...);
}

/// Appends tokens [begin, begin + count) of `src` (clipped to each source head's valid length) after each head's
/// valid length in `dst`: K and V rows (converted to dst's element types), positions (src's, or src's slot numbers
/// when src has none) and lengths. `dst` needs a length table (per head, or per sequence when every head of a
/// sequence appends the same count: an error on the CPU, a precondition on CUDA). Errors, checked before anything is
/// written: a head would pass dst's capacity (out_of_capacity on the CPU; CUDA clamps at capacity, since the device
/// cannot report it: engines know their lengths and size the cache), dims differ (invalid_argument). New tokens'
/// keys must already be rotated for their positions; give `src` a positions table for them (without one, src's
/// slot numbers are used, which is right when src is the whole prompt, as in the block-wise driver).
template <Backend B, KVCacheView Dst, KVCacheView Src>
Status append(B const& backend, Dst const& dst, Src const& src, Index begin, Index count) {
  static_assert(AccessibleFrom<Src, B> && AccessibleFrom<Dst, B>,
                "kvc::append: the caches live in a memory space this backend cannot read");
  static_assert(HasKernel<AppendStep, B>,
                "kvc::append: include <kvc/backend/cpu/pipeline/compact.hpp> (kvc::Cpu) or "
                "<kvc/backend/cuda/pipeline/compact.cuh> (kvc::Cuda)");
  KVExtents const se = src.keys.extents(), de = dst.keys.extents();
  KVC_RETURN_IF_ERROR(detail::check_cache(dst, KVC_CACHE_MESSAGES("kvc::append", "`dst`")));
  KVC_RETURN_IF_ERROR(detail::check_cache(src, KVC_CACHE_MESSAGES("kvc::append", "`src`")));
  if (de.batch != se.batch || de.heads != se.heads || de.dim != se.dim ||
      dst.values.extents().dim != src.values.extents().dim)
    return {Errc::invalid_argument, "kvc::append: `dst` and `src` must agree on batch, heads and dims"};
  if (begin < 0 || count < 0)
    return {Errc::invalid_argument, "kvc::append: `begin` and `count` must be >= 0"};
  if (dst.lengths.data == nullptr)
    return {Errc::invalid_argument, "kvc::append: `dst` needs a length table (Lengths) to grow"};
  if (detail::overlaps_cache(detail::bytes_of(dst.keys), src) ||
      detail::overlaps_cache(detail::bytes_of(dst.values), src))
    return {Errc::invalid_argument, "kvc::append: `dst` overlaps `src`'s keys or values"};
  return Kernel<AppendStep, B>::run(backend, dst, src, begin, count);
}

/// Appends all valid tokens of `src` (new tokens' K and V, [batch, heads, m, d]).
template <Backend B, KVCacheView Dst, KVCacheView Src>
Status append(B const& backend, Dst const& dst, Src const& src) {
  return append(backend, dst, src, 0, src.keys.extents().tokens);
}

/// Checks a host plan against a cache's shape: counts in [0, min(capacity, length(b, h))], indices strictly
/// ascending inside [0, length(b, h)), lengths inside [0, tokens]. Host compaction runs it before moving anything.
template <KVCacheView C>
Status validate_plan(KeepPlan<HostSpace> const& plan, C const& cache) noexcept {
  KVExtents const e = cache.keys.extents();
  if (plan.batch != e.batch || plan.heads != e.heads)
    return {Errc::invalid_argument, "KeepPlan: batch and heads must match the cache"};
  if ((plan.index == nullptr || plan.count == nullptr) && plan.batch * plan.heads > 0)
    return {Errc::invalid_argument, "KeepPlan: `index` and `count` must not be null"};
  for (Index b = 0; b < plan.batch; ++b)
    for (Index h = 0; h < plan.heads; ++h) {
      Index const n = cache.length(b, h);
      if (n < 0 || n > e.tokens)
        return {Errc::invalid_argument, "KeepPlan: the cache's valid length must be in [0, tokens]"};
      Index const count = plan.kept(b, h);
      if (count < 0 || count > plan.capacity || count > n)
        return {Errc::invalid_argument, "KeepPlan: `count` must be in [0, min(capacity, length)]"};
      Index const* idx = plan.indices(b, h);
      for (Index j = 0; j < count; ++j)
        if (idx[j] < 0 || idx[j] >= n || (j > 0 && idx[j] <= idx[j - 1]))
          return {Errc::invalid_argument, "KeepPlan: indices must be strictly ascending and inside [0, length)"};
    }
  return {};
}

}  // namespace kvc
