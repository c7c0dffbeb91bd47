// SPDX-License-Identifier: Apache-2.0
// kvc/core/checks.hpp: the cheap checks every entry point runs on every call (docs/api_checks.md): extents that fit
// in 64 bits, V's shape against K's, the length table's shape, each head's length against its own capacity (host
// tables), non-null pointers a shape needs, and the address ranges of buffers, so that an output over the cache is
// refused. Each costs O(batch x heads) or less and reads no device memory, so the backend-generic entry points run
// them for every backend; what costs O(data) (page ids, positions, buffer sizes) stays in kvc::validate.
#pragma once

#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

namespace kvc::detail {

/// r = a + b; false when the exact sum does not fit in 64 bits.
constexpr bool checked_add(Index a, Index b, Index& r) noexcept {
  return !__builtin_add_overflow(a, b, &r);
}

/// The rows a view can address, as (stride, extent) axes over rows of `dim` elements: a strided view's batch, head
/// and token axes; a paged view's pool (page, in-page head, in-page token: every page id in [0, num_pages)); a
/// per-head paged view's pool (page, in-page token); a host ragged view's buffer rows. Axes of extent 1 add no
/// offset and are left out; the rest are sorted by stride. `empty`: no row at all.
struct RowAxes {
  struct Axis {
    Index stride = 0, extent = 0;
    friend constexpr bool operator==(Axis, Axis) = default;
  };
  Axis axis[3];
  int count = 0;
  Index dim = 0;
  bool empty = false;

  constexpr RowAxes(Index d, bool none, Axis a, Axis b, Axis c) noexcept : dim(d), empty(none) {
    for (Axis const x : {a, b, c}) {
      if (x.extent <= 1)
        continue;
      int i = count++;  // insertion by stride (three axes at most; std::sort here trips GCC 12's -Warray-bounds)
      for (; i > 0 && axis[i - 1].stride > x.stride; --i)
        axis[i] = axis[i - 1];
      axis[i] = x;
    }
  }
};

inline RowAxes row_axes(StridedLayout const& l) noexcept {
  KVExtents const e = l.ext;
  return {e.dim,
          e.batch == 0 || e.heads == 0 || e.tokens == 0,
          {l.stride_b, e.batch},
          {l.stride_h, e.heads},
          {l.stride_t, e.tokens}};
}

inline RowAxes row_axes(PagedLayout const& l) noexcept {
  KVExtents const e = l.ext;
  Index const in_page = l.page_size < e.tokens ? l.page_size : e.tokens;  // token slots of a page the view uses
  return {e.dim,
          e.batch == 0 || e.heads == 0 || in_page <= 0 || l.num_pages <= 0,
          {l.stride_page, l.num_pages},
          {l.stride_h, e.heads},
          {l.stride_t, in_page}};
}

inline RowAxes row_axes(HeadPagedLayout const& l) noexcept {
  KVExtents const e = l.ext;
  return {e.dim,
          e.batch == 0 || e.heads == 0 || l.page_size <= 0 || l.num_pages <= 0,
          {l.stride_page, l.num_pages},
          {l.stride_t, l.page_size},
          {}};
}

/// A ragged view's rows [0, offsets[batch * heads]) of one buffer: `rows` is that count, read by the caller from
/// host offsets (device offsets cannot be read on the host: see view_axes).
inline RowAxes row_axes(RaggedLayout const& l, Index rows) noexcept {
  return {l.ext.dim, rows <= 0, {l.stride_t, rows}, {}, {}};
}

enum class SpanError { none, overlap, overflow };

/// Elements spanned by the rows (largest offset + dim; 0 when there is no row), saturated at the largest Index when
/// it overflows. Rows never overlap iff each stride covers everything inside it (the block of the smaller axes):
/// reports `overlap` when one does not, `overflow` when the span does not fit (the first of the two). Strides
/// must be >= 0.
inline SpanError axes_span(RowAxes const& a, Index& span) noexcept {
  span = 0;
  if (a.empty)
    return SpanError::none;  // no row, nothing to overlap: an empty token dimension is valid whatever its strides
  SpanError error = SpanError::none;
  Index inner = a.dim;
  span = a.dim;
  for (int i = 0; i < a.count; ++i) {
    RowAxes::Axis const x = a.axis[i];
    Index step = 0;
    if (x.stride < inner && error == SpanError::none)
      error = SpanError::overlap;
    if (!checked_product(step, x.stride, x.extent - 1) || !checked_add(span, step, span)) {
      span = std::numeric_limits<Index>::max();
      return error == SpanError::none ? SpanError::overflow : error;
    }
    if (!checked_product(inner, x.stride, x.extent))
      inner = std::numeric_limits<Index>::max();  // any larger stride is then too small: its rows overlap
  }
  return error;
}

/// The axes of a K or V view, when they can be known on the host: every layout but a ragged one in device memory
/// (its row count is in the device offsets). False for unknown axes or a layout other than kvc's four.
template <TokenRowsView R>
bool view_axes(R const& rows, RowAxes& axes) noexcept {
  using L = typename R::layout_type;
  auto const& l = rows.layout();
  if constexpr (std::is_same_v<L, RaggedLayout>) {
    if constexpr (!std::is_same_v<typename R::memory_space, HostSpace>) {
      return false;
    } else {
      Index const heads = l.ext.batch * l.ext.heads;  // fits: the caller checked the extents
      axes = row_axes(l, heads > 0 && l.offsets ? l.offsets[heads] : 0);
      return true;
    }
  } else if constexpr (requires { row_axes(l); }) {
    axes = row_axes(l);
    return true;
  } else {
    return false;
  }
}

/// The bytes [begin, end) a buffer can touch; begin == end: none (it overlaps nothing).
struct ByteRange {
  std::uintptr_t begin = 0, end = 0;
};

/// Whether two ranges share a byte.
constexpr bool overlap(ByteRange a, ByteRange b) noexcept {
  return a.begin < a.end && b.begin < b.end && a.begin < b.end && b.begin < a.end;
}

/// The bytes of `count` elements at p (a null pointer or count <= 0: none). A count whose bytes would pass the end
/// of the address space reaches to its end.
template <class T>
ByteRange bytes_of(T const* p, Index count) noexcept {
  auto const begin = reinterpret_cast<std::uintptr_t>(p);
  if (p == nullptr || count <= 0)
    return {};
  std::uintptr_t bytes = 0, end = 0;
  if (__builtin_mul_overflow(static_cast<std::uintptr_t>(count), sizeof(T), &bytes) ||
      __builtin_add_overflow(begin, bytes, &end))
    end = std::numeric_limits<std::uintptr_t>::max();
  return {begin, end};
}

/// The bytes a K or V view can touch: every row its layout addresses (strided: the extents; paged and per-head
/// paged: the whole pool; ragged: the rows of the host offsets), whatever the valid lengths. None when it cannot be
/// known on the host (a device ragged view) or for strides < 0 (which kvc::validate rejects).
template <TokenRowsView R>
ByteRange bytes_of(R const& rows) noexcept {
  RowAxes axes{0, true, {}, {}, {}};
  if (rows.data() == nullptr || !view_axes(rows, axes))
    return {};
  for (int i = 0; i < axes.count; ++i)
    if (axes.axis[i].stride < 0)
      return {};
  Index span = 0;
  (void)axes_span(axes, span);  // overlapping rows still span their addresses
  return bytes_of(rows.data(), span);
}

/// The bytes of a workspace.
inline ByteRange bytes_of(Workspace const& ws) noexcept {
  constexpr auto most = static_cast<std::size_t>(std::numeric_limits<Index>::max());
  return bytes_of(static_cast<std::byte const*>(ws.data), static_cast<Index>(ws.bytes < most ? ws.bytes : most));
}

/// The bytes of a plan's two arrays: `index` [batch, heads, capacity] and `count` [batch, heads].
struct PlanBytes {
  ByteRange index, count;
};
template <class Space>
PlanBytes bytes_of(KeepPlan<Space> const& plan) noexcept {
  return {bytes_of(plan.index, saturating_product(plan.batch, plan.heads, plan.capacity)),
          bytes_of(plan.count, saturating_product(plan.batch, plan.heads))};
}

/// Whether `range` overlaps the keys or the values of `cache` (for a buffer an entry point writes while it reads
/// the cache, or reads while it writes the cache: either way one would corrupt the other).
template <KVCacheView C>
bool overlaps_cache(ByteRange range, C const& cache) noexcept {
  return overlap(range, bytes_of(cache.keys)) || overlap(range, bytes_of(cache.values));
}
template <KVCacheView C>
bool overlaps_cache(PlanBytes const& plan, C const& cache) noexcept {
  return overlaps_cache(plan.index, cache) || overlaps_cache(plan.count, cache);
}

/// Whether scores' extents are >= 0 with batch * heads * tokens elements within Index (so size() can be computed).
template <class Space>
constexpr bool scores_fit(ScoreSpan<Space> const& scores) noexcept {
  Index n = 0;
  return scores.batch >= 0 && scores.heads >= 0 && scores.tokens >= 0 &&
         checked_product(n, scores.batch, scores.heads, scores.tokens);
}

/// Messages of check_cache, each naming the entry point and the cache argument (string literals: a Status never
/// allocates). Built by KVC_CACHE_MESSAGES.
struct CacheMessages {
  char const* extents;  ///< negative extents, dim <= 0, or more elements than fit in 64 bits (K or V)
  char const* values;   ///< V's batch, heads or tokens differ from K's
  char const* data;     ///< a null data pointer or layout table where the views have rows
  char const* table;    ///< a per-head length table of another head count
  char const* lengths;  ///< a valid length outside [0, its head's capacity] (host tables)
};

/// The CacheMessages of entry point `entry` (a string literal, e.g. "kvc::attend") for its cache argument `what`
/// (e.g. "the cache", "`dst`").
#define KVC_CACHE_MESSAGES(entry, what)                                                                           \
  ::kvc::detail::CacheMessages {                                                                                  \
    entry ": " what " has a negative extent, dim <= 0, or more K or V elements than fit in 64 bits",              \
        entry ": " what "'s values must have its keys' batch, heads and tokens",                                  \
        entry ": " what                                                                                           \
              "'s keys or values data pointer, or its layout's table (ragged offsets, block table, CSR "          \
              "lists), is null",                                                                                  \
        entry ": " what "'s per-head length table must be [batch, KV heads]",                                     \
        entry ": every valid length of " what " must be in [0, its head's capacity] (a ragged head: its segment)" \
  }

/// Whether a layout has the tables its offsets read where it needs them: ragged offsets for any head (capacity
/// reads them), page tables for any row; strided layouts have none.
template <class L>
constexpr bool layout_tables_set(L const& l) noexcept {
  KVExtents const e = l.ext;  // extents_fit already: the products below do not overflow
  if constexpr (std::is_same_v<L, RaggedLayout>)
    return l.offsets != nullptr || e.batch * e.heads == 0;
  else if constexpr (std::is_same_v<L, PagedLayout>)
    return e.rows() == 0 || (l.page_indptr ? l.page_indices != nullptr : l.block_table != nullptr);
  else if constexpr (std::is_same_v<L, HeadPagedLayout>)
    return e.rows() == 0 || l.block_table != nullptr;
  else
    return true;
}

/// The per-call checks of a cache (O(batch x heads), no device memory read), in this order because later ones
/// multiply what earlier ones checked: K and V extents fit (extents_fit); V's batch, heads and tokens equal K's; K
/// and V data and layout tables non-null where the views have rows; the length table's shape; for host caches,
/// every valid length in [0, capacity(b, h)], so a ragged head never reads past its own segment. Device lengths
/// are clamped by the kernels instead.
template <KVCacheView C>
Status check_cache(C const& cache, CacheMessages const& m) noexcept {
  KVExtents const k = cache.keys.extents(), v = cache.values.extents();
  if (!extents_fit(k) || !extents_fit(v))
    return {Errc::invalid_argument, m.extents};
  if (v.batch != k.batch || v.heads != k.heads || v.tokens != k.tokens)
    return {Errc::invalid_argument, m.values};
  if ((k.rows() > 0 && (cache.keys.data() == nullptr || cache.values.data() == nullptr)) ||
      !layout_tables_set(cache.keys.layout()) || !layout_tables_set(cache.values.layout()))
    return {Errc::invalid_argument, m.data};
  KVC_RETURN_IF_ERROR(check_length_table(cache.lengths, k.heads, m.table));
  if constexpr (std::is_same_v<typename C::memory_space, HostSpace>) {
    if (cache.lengths.data)
      for (Index b = 0; b < k.batch; ++b)
        for (Index h = 0; h < k.heads; ++h)
          if (Index const n = cache.length(b, h); n < 0 || n > cache.capacity(b, h))
            return {Errc::invalid_argument, m.lengths};
  }
  return {};
}

/// A cache that a driver compacts in place must record each head's new count: a per-head length table (or any
/// table for a single head, where per sequence is per head). Without one, compaction leaves the cache claiming its
/// old lengths, the stale rows behind the kept ones still counted.
constexpr Status check_compactable_lengths(Lengths const& lengths, Index heads, char const* what) noexcept {
  return lengths.data == nullptr || (!lengths.per_head() && heads > 1) ? Status{Errc::invalid_argument, what}
                                                                       : Status{};
}

}  // namespace kvc::detail
