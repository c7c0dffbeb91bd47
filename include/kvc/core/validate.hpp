// SPDX-License-Identifier: Apache-2.0
// kvc/core/validate.hpp: opt-in checks of a cache view before it is handed to kernels.
#pragma once

#include <kvc/core/element.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/status.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace kvc {

struct ValidateOptions {
  bool check_finite = false;  ///< scan every valid element for NaN/Inf (host memory only; O(cache size))
};

namespace detail {

/// Whether a*b overflows int64 for non-negative operands.
constexpr bool mul_overflows(Index a, Index b) noexcept {
  Index r = 0;
  return __builtin_mul_overflow(a, b, &r);
}

/// Elements spanned by a strided view: max offset + dim. Also checks that rows never overlap each other.
inline Status strided_span(StridedLayout const& l, Index& span) noexcept {
  KVExtents const e = l.ext;
  if (l.stride_b < 0 || l.stride_h < 0 || l.stride_t < 0)
    return {Errc::invalid_argument, "StridedLayout: strides must be >= 0"};
  struct Axis {
    Index stride, extent;
  } axes[3] = {{l.stride_b, e.batch}, {l.stride_h, e.heads}, {l.stride_t, e.tokens}};
  std::sort(axes, axes + 3, [](Axis a, Axis b) { return a.stride < b.stride; });
  Index inner = e.dim;  // rows never overlap iff each stride (of an extent > 1) covers everything inside it
  span = e.dim;
  for (Axis const& a : axes) {
    if (a.extent <= 1)
      continue;
    if (a.stride < inner)
      return {Errc::invalid_argument, "StridedLayout: rows overlap (a stride is smaller than the block inside it)"};
    if (mul_overflows(a.stride, a.extent - 1) || mul_overflows(a.stride, a.extent))
      return {Errc::invalid_argument, "StridedLayout: offsets overflow 64 bits"};
    span += a.stride * (a.extent - 1);
    inner = a.stride * a.extent;
  }
  return {};
}

template <class L>
Status layout_status(L const& l) noexcept {
  KVExtents const e = l.ext;
  if (e.batch < 0 || e.heads < 0 || e.tokens < 0 || e.dim <= 0)
    return {Errc::invalid_argument, "KVExtents: batch, heads, tokens must be >= 0 and dim > 0"};
  if (mul_overflows(e.batch, e.heads) || mul_overflows(e.batch * e.heads, e.tokens) ||
      mul_overflows(e.batch * e.heads * e.tokens, e.dim))
    return {Errc::invalid_argument, "KVExtents: batch * heads * tokens * dim overflows 64 bits"};
  if constexpr (std::is_same_v<L, StridedLayout>) {
    Index span = 0;
    return strided_span(l, span);
  } else if constexpr (std::is_same_v<L, PagedLayout>) {
    if (l.page_size <= 0)
      return {Errc::invalid_argument, "PagedLayout: `page_size` must be > 0"};
    if (l.num_pages <= 0 && e.rows() > 0)
      return {Errc::invalid_argument, "PagedLayout: `num_pages` (the pool's size) must be > 0"};
    if (l.page_indptr == nullptr && mul_overflows(l.max_pages, l.page_size))
      return {Errc::invalid_argument, "PagedLayout: max_pages * page_size overflows 64 bits"};
    if (l.page_indptr == nullptr && (l.block_table == nullptr || l.max_pages * l.page_size < e.tokens))
      return {Errc::invalid_argument, "PagedLayout: need a block table with max_pages * page_size >= tokens, or CSR"};
    if (l.page_indptr != nullptr && (l.page_indices == nullptr || l.num_page_indices < 0))
      return {Errc::invalid_argument, "PagedLayout: CSR mode needs `page_indices` and `num_page_indices` >= 0"};
    // With one token per page stride_t never applies, so only the head stride decides the order (HND then equals
    // NHD: [heads, dim] per page).
    bool const nhd = l.page_size == 1 || l.stride_t >= l.stride_h;
    Index const inner =
        l.page_size == 1 ? l.stride_h * e.heads : (nhd ? l.stride_t * l.page_size : l.stride_h * e.heads);
    if (l.stride_h < (nhd ? e.dim : e.dim * l.page_size) ||
        (l.page_size > 1 && l.stride_t < (nhd ? e.dim * e.heads : e.dim)) || l.stride_page < inner)
      return {Errc::invalid_argument, "PagedLayout: in-page strides overlap rows or pages"};
    if (mul_overflows(l.stride_page, l.num_pages))
      return {Errc::invalid_argument, "PagedLayout: stride_page * num_pages overflows 64 bits"};
    return {};
  } else {
    return {};
  }
}

/// Host page tables: every page id a valid token uses is in [0, num_pages); CSR lists are non-decreasing, inside
/// the declared index array, and long enough for the sequence.
inline Status pages_status(PagedLayout const& l, Lengths const& lengths) noexcept {
  KVExtents const e = l.ext;
  if (l.page_indptr) {  // the whole index pointer first: no page id is read through an unchecked entry
    if (l.page_indptr[0] < 0)
      return {Errc::invalid_argument, "PagedLayout: `page_indptr[0]` must be >= 0"};
    for (Index b = 0; b < e.batch; ++b)
      if (l.page_indptr[b + 1] < l.page_indptr[b])
        return {Errc::invalid_argument, "PagedLayout: `page_indptr` must be non-decreasing"};
    if (l.page_indptr[e.batch] > l.num_page_indices)
      return {Errc::invalid_argument, "PagedLayout: `page_indptr` points outside `page_indices` (num_page_indices)"};
  }
  for (Index b = 0; b < e.batch; ++b) {
    Index longest = 0;
    for (Index h = 0; h < e.heads; ++h)
      longest = std::max(longest, lengths.at(b, h, e.tokens));
    Index const pages = (longest + l.page_size - 1) / l.page_size;
    if (l.page_indptr && (l.page_indptr[b + 1] < l.page_indptr[b] || l.page_indptr[b + 1] - l.page_indptr[b] < pages))
      return {Errc::invalid_argument, "PagedLayout: a sequence's CSR page list is shorter than its valid length"};
    if (!l.page_indptr && pages > l.max_pages)
      return {Errc::invalid_argument, "PagedLayout: a valid length needs more than `max_pages` pages"};
    for (Index p = 0; p < pages; ++p) {
      Index const id = l.page_indptr ? l.page_indices[l.page_indptr[b] + p] : l.block_table[b * l.max_pages + p];
      if (id < 0 || id >= l.num_pages)
        return {Errc::invalid_argument,
                "PagedLayout: a page id used within the valid length is outside the pool [0, num_pages)"};
    }
  }
  return {};
}

template <class R>
Status rows_finite(R const& rows, Lengths const& lengths) noexcept {
  KVExtents const e = rows.extents();
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h)
      for (Index t = 0; t < lengths.at(b, h, e.tokens); ++t) {
        auto const* r = rows.row(b, h, t);
        for (Index i = 0; i < e.dim; ++i)
          if (!std::isfinite(to_float(r[i])))
            return {Errc::non_finite, "kvc::validate: K or V holds NaN or Inf"};
      }
  return {};
}

/// Whether two strided views share memory (compaction would then corrupt one with the other). Views with the same
/// strides and element size interleave row by row when one sits in the other's row gaps (a packed K||V buffer):
/// they are disjoint iff V's row lies inside the gap after K's row, or K's inside the gap after V's. Other views
/// are compared by their address spans.
template <class K, class V>
bool strided_overlap(K const& keys, V const& values) noexcept {
  StridedLayout const kl = keys.layout(), vl = values.layout();
  auto const ke = static_cast<std::intptr_t>(sizeof(*keys.data())),
             ve = static_cast<std::intptr_t>(sizeof(*values.data()));
  auto const k0 = reinterpret_cast<std::intptr_t>(keys.data()), v0 = reinterpret_cast<std::intptr_t>(values.data());
  if (ke == ve && kl.stride_b == vl.stride_b && kl.stride_h == vl.stride_h && kl.stride_t == vl.stride_t) {
    Index pitch = -1;  // the smallest stride of an axis that has more than one row: the room each row has
    Index const strides[3] = {kl.stride_b, kl.stride_h, kl.stride_t};
    Index const extents[3] = {kl.ext.batch, kl.ext.heads, kl.ext.tokens};
    for (int a = 0; a < 3; ++a)
      if (extents[a] > 1 && (pitch < 0 || strides[a] < pitch))
        pitch = strides[a];
    if (pitch > 0) {
      std::intptr_t const delta = v0 - k0, room = static_cast<std::intptr_t>(pitch) * ke;
      std::intptr_t const kbytes = static_cast<std::intptr_t>(kl.ext.dim) * ke,
                          vbytes = static_cast<std::intptr_t>(vl.ext.dim) * ve;
      if ((delta >= kbytes && delta + vbytes <= room) || (-delta >= vbytes && -delta + kbytes <= room))
        return false;
    }
  }
  Index ks = 0, vs = 0;
  (void)strided_span(kl, ks);
  (void)strided_span(vl, vs);
  std::intptr_t const k1 = k0 + static_cast<std::intptr_t>(ks) * ke, v1 = v0 + static_cast<std::intptr_t>(vs) * ve;
  return k0 < v1 && v0 < k1;
}

}  // namespace detail

/// Checks one K or V view: extents, 64-bit offsets, non-overlapping rows, paged tables (host: every page id a
/// valid token uses); lengths in [0, tokens] and, when asked, finiteness of every valid row (host views).
template <TokenRowsView R>
Status validate_rows(R const& rows, ValidateOptions opts = {}, Lengths lengths = {}) noexcept {
  KVC_RETURN_IF_ERROR(detail::layout_status(rows.layout()));
  if (rows.data() == nullptr && rows.extents().rows() > 0)
    return {Errc::invalid_argument, "kvc::validate: K or V data pointer is null"};
  KVC_RETURN_IF_ERROR(check_length_table(
      lengths, rows.extents().heads, "kvc::validate: a per-head length table must be [batch, the cache's KV heads]"));
  if constexpr (std::is_same_v<typename R::memory_space, HostSpace>) {
    KVExtents const e = rows.extents();
    if (lengths.data)
      for (Index b = 0; b < e.batch; ++b)
        for (Index h = 0; h < (lengths.per_head() ? e.heads : 1); ++h)
          if (lengths.at(b, h, e.tokens) < 0 || lengths.at(b, h, e.tokens) > e.tokens)
            return {Errc::invalid_argument, "kvc::validate: every valid length must be in [0, tokens]"};
    if constexpr (std::is_same_v<typename R::layout_type, PagedLayout>)
      KVC_RETURN_IF_ERROR(detail::pages_status(rows.layout(), lengths));
    if (opts.check_finite)
      return detail::rows_finite(rows, lengths);
  }
  return {};
}

/// Checks a host or device cache's shapes and layouts (and, for host caches, its tables and optionally
/// finiteness): extents non-negative with dim > 0; K and V agree on batch, heads and tokens; element offsets fit in
/// 64 bits; strided rows do not overlap; K and V do not overlap. Host caches also: lengths in [0, tokens]; every
/// page id used within the valid lengths inside the pool; positions of each head >= 0 and strictly ascending.
/// Device caches' tables are not read (kernels clamp lengths to [0, tokens]).
template <KVCacheView C>
Status validate(C const& cache, ValidateOptions opts = {}) noexcept {
  KVC_RETURN_IF_ERROR(validate_rows(cache.keys, {}, cache.lengths));  // extents first: later checks multiply them
  KVC_RETURN_IF_ERROR(validate_rows(cache.values, {}, cache.lengths));
  KVExtents const k = cache.keys.extents(), v = cache.values.extents();
  if (k.batch != v.batch || k.heads != v.heads || k.tokens != v.tokens)
    return {Errc::invalid_argument, "kvc::validate: keys and values must agree on batch, heads and tokens"};
  if constexpr (std::is_same_v<typename decltype(cache.keys)::layout_type, StridedLayout> &&
                std::is_same_v<typename decltype(cache.values)::layout_type, StridedLayout>) {
    if (k.rows() > 0 && detail::strided_overlap(cache.keys, cache.values))
      return {Errc::invalid_argument, "kvc::validate: K and V memory overlap"};
  }
  if constexpr (std::is_same_v<typename C::memory_space, HostSpace>) {
    if (cache.positions)
      for (Index b = 0; b < k.batch; ++b)
        for (Index h = 0; h < k.heads; ++h)
          for (Index t = 0; t < cache.length(b, h); ++t)
            if (cache.position(b, h, t) < 0 || (t > 0 && cache.position(b, h, t) <= cache.position(b, h, t - 1)))
              return {Errc::invalid_argument, "kvc::validate: positions of a head must be >= 0 and strictly ascending"};
    if (opts.check_finite) {
      KVC_RETURN_IF_ERROR(detail::rows_finite(cache.keys, cache.lengths));
      KVC_RETURN_IF_ERROR(detail::rows_finite(cache.values, cache.lengths));
    }
  }
  return {};
}

}  // namespace kvc
