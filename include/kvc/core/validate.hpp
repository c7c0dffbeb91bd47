// SPDX-License-Identifier: Apache-2.0
// kvc/core/validate.hpp: opt-in checks of a cache view before it is handed to kernels.
#pragma once

#include <kvc/core/checks.hpp>
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
  /// Scan every valid element for NaN/Inf and for dim * x^2 >= 2^126 (host memory only; O(cache size)): within
  /// that range every squared norm, dot product q.k and attention logit of `dim` products stays finite in fp32,
  /// even after a RoPE rotation grows a component by sqrt(2). Implies check_finite.
  bool check_range = false;
};

/// Whether `x` is inside the exact range of head dim `dim`: dim * x^2 < 2^126 (|x| < 8.1e17 at dim 128), where every
/// squared norm, dot product and logit of `dim` products stays finite in fp32 (ValidateOptions::check_range).
constexpr bool in_exact_range(double x, Index dim) noexcept {
  return x * x * static_cast<double>(dim) < 0x1p126;
}

namespace detail {

/// Layouts whose rows layout_status checks through their axes (the others have their own field checks).
template <class L>
inline constexpr bool axes_layout = std::is_same_v<L, StridedLayout> || std::is_same_v<L, PagedLayout>;

/// Elements spanned by a layout that layout_status accepted (0 for layouts without axes).
template <class L>
Index layout_span(L const& l) noexcept {
  Index span = 0;
  if constexpr (axes_layout<L>)
    (void)axes_span(row_axes(l), span);
  return span;
}

template <class L>
Status layout_status(L const& l) noexcept {
  constexpr bool paged = std::is_same_v<L, PagedLayout>;
  KVExtents const e = l.ext;
  Index n = 0;
  if (e.batch < 0 || e.heads < 0 || e.tokens < 0 || e.dim <= 0)
    return {Errc::invalid_argument, "KVExtents: batch, heads, tokens must be >= 0 and dim > 0"};
  if (!checked_product(n, e.batch, e.heads, e.tokens, e.dim))
    return {Errc::invalid_argument, "KVExtents: batch * heads * tokens * dim overflows 64 bits"};
  if constexpr (std::is_same_v<L, StridedLayout>) {
    if (l.stride_b < 0 || l.stride_h < 0 || l.stride_t < 0)
      return {Errc::invalid_argument, "StridedLayout: strides must be >= 0"};
  } else if constexpr (paged) {
    if (l.page_size <= 0)
      return {Errc::invalid_argument, "PagedLayout: `page_size` must be > 0"};
    struct Field {
      Index value;
      char const* message;
    } const fields[] = {
        {l.stride_page, "PagedLayout: `stride_page` must be >= 0"},
        {l.stride_h, "PagedLayout: `stride_h` must be >= 0"},
        {l.stride_t, "PagedLayout: `stride_t` must be >= 0"},
        {l.num_pages, "PagedLayout: `num_pages` must be >= 0"},
        {l.max_pages, "PagedLayout: `max_pages` must be >= 0"},
        {l.num_page_indices, "PagedLayout: `num_page_indices` must be >= 0"},
    };
    for (Field const& f : fields)
      if (f.value < 0)
        return {Errc::invalid_argument, f.message};
    if (l.num_pages == 0 && e.rows() > 0)
      return {Errc::invalid_argument, "PagedLayout: `num_pages` (the pool's size) must be > 0"};
    if (l.page_indptr == nullptr) {
      if (!checked_product(n, l.max_pages, l.page_size))
        return {Errc::invalid_argument, "PagedLayout: max_pages * page_size overflows 64 bits"};
      if (l.block_table == nullptr || n < e.tokens)
        return {Errc::invalid_argument, "PagedLayout: need a block table with max_pages * page_size >= tokens, or CSR"};
      if (!checked_product(n, e.batch, l.max_pages))
        return {Errc::invalid_argument, "PagedLayout: the block table's size batch * max_pages overflows 64 bits"};
    } else if (l.page_indices == nullptr) {
      return {Errc::invalid_argument, "PagedLayout: CSR mode needs `page_indices`"};
    }
  }
  if constexpr (std::is_same_v<L, RaggedLayout>) {
    if (l.stride_t < e.dim)
      return {Errc::invalid_argument, "RaggedLayout: `stride_t` must be >= dim (rows would overlap)"};
    if (l.offsets == nullptr && e.batch * e.heads > 0)
      return {Errc::invalid_argument, "RaggedLayout: `offsets` ([batch * heads + 1]) must not be null"};
  } else if constexpr (std::is_same_v<L, HeadPagedLayout>) {
    if (l.page_size <= 0 || l.stride_t < e.dim || l.max_pages < 0 || l.num_pages < 0)
      return {Errc::invalid_argument,
              "HeadPagedLayout: `page_size` must be > 0, `stride_t` >= dim, `max_pages` and `num_pages` >= 0"};
    if (!checked_product(n, l.page_size, l.stride_t) || l.stride_page < n)
      return {Errc::invalid_argument, "HeadPagedLayout: `stride_page` must be >= page_size * stride_t"};
    if (!checked_product(n, l.max_pages, l.page_size) || n < e.tokens || (l.block_table == nullptr && e.rows() > 0))
      return {Errc::invalid_argument, "HeadPagedLayout: need a block table with max_pages * page_size >= tokens"};
    if (!checked_product(n, e.batch * e.heads, l.max_pages) || !checked_product(n, l.num_pages, l.stride_page))
      return {Errc::invalid_argument, "HeadPagedLayout: the block table or the pool overflows 64 bits"};
  }
  if constexpr (axes_layout<L>) {
    Index span = 0;
    SpanError const error = axes_span(row_axes(l), span);
    if (error == SpanError::overlap)
      return {Errc::invalid_argument,
              paged ? "PagedLayout: rows overlap (a page or in-page stride is smaller than the block inside it)"
                    : "StridedLayout: rows overlap (a stride is smaller than the block inside it)"};
    if (error == SpanError::overflow)
      return {Errc::invalid_argument,
              paged ? "PagedLayout: pool offsets overflow 64 bits" : "StridedLayout: offsets overflow 64 bits"};
  }
  return {};
}

/// Host page tables: every page id a valid token uses is in [0, num_pages); CSR lists are non-decreasing, inside
/// the declared index array, and long enough for the sequence. Needs layout_status and the lengths checked first.
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
    Index const pages = longest / l.page_size + (longest % l.page_size != 0);  // ceil without overflow
    if (l.page_indptr && Index{l.page_indptr[b + 1]} - l.page_indptr[b] < pages)
      return {Errc::invalid_argument, "PagedLayout: a sequence's CSR page list is shorter than its valid length"};
    if (!l.page_indptr && pages > l.max_pages)
      return {Errc::invalid_argument, "PagedLayout: a valid length needs more than `max_pages` pages"};
    for (Index p = 0; p < pages; ++p) {  // b * max_pages + p < batch * max_pages, checked by layout_status
      Index const id = l.page_indptr ? l.page_indices[l.page_indptr[b] + p] : l.block_table[b * l.max_pages + p];
      if (id < 0 || id >= l.num_pages)
        return {Errc::invalid_argument,
                "PagedLayout: a page id used within the valid length is outside the pool [0, num_pages)"};
    }
  }
  return {};
}

/// Host ragged offsets: offsets[0] = 0, non-decreasing, every segment within ext.tokens, and the buffer's element
/// offsets inside 64 bits.
inline Status ragged_status(RaggedLayout const& l) noexcept {
  KVExtents const e = l.ext;
  Index const heads = e.batch * e.heads;
  if (heads == 0)
    return {};
  if (l.offsets[0] != 0)
    return {Errc::invalid_argument, "RaggedLayout: `offsets[0]` must be 0"};
  for (Index i = 0; i < heads; ++i) {
    Index const cap = l.offsets[i + 1] - l.offsets[i];
    if (l.offsets[i + 1] < l.offsets[i] || cap > e.tokens)
      return {Errc::invalid_argument,
              "RaggedLayout: `offsets` must be non-decreasing, each segment at most ext.tokens (the largest) long"};
  }
  Index n = 0;
  if (!checked_product(n, l.offsets[heads], l.stride_t))
    return {Errc::invalid_argument, "RaggedLayout: the buffer's offsets overflow 64 bits"};
  return {};
}

/// Host per-head page tables: every page id a valid token uses is in [0, num_pages).
inline Status head_pages_status(HeadPagedLayout const& l, Lengths const& lengths) noexcept {
  KVExtents const e = l.ext;
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h) {
      Index const n = lengths.at(b, h, e.tokens);
      for (Index p = 0; p < n / l.page_size + (n % l.page_size != 0); ++p) {
        Index const id = l.block_table[(b * e.heads + h) * l.max_pages + p];
        if (id < 0 || id >= l.num_pages)
          return {Errc::invalid_argument,
                  "HeadPagedLayout: a page id used within a head's valid length is outside the pool [0, num_pages)"};
      }
    }
  return {};
}

/// The one scan of every valid element: NaN/Inf, and with `check_range` dim * x^2 >= 2^126 (computed in double).
template <class R>
Status rows_finite(R const& rows, Lengths const& lengths, bool check_range) noexcept {
  KVExtents const e = rows.extents();
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h)
      for (Index t = 0; t < lengths.at(b, h, e.tokens); ++t) {
        auto const* r = rows.row(b, h, t);
        for (Index i = 0; i < e.dim; ++i) {
          double const x = load(r[i], rows.scale(b, h));
          if (!std::isfinite(x))
            return {Errc::non_finite, "kvc::validate: K or V holds NaN or Inf"};
          if (check_range && !in_exact_range(x, e.dim))
            return {Errc::invalid_argument,
                    "kvc::validate: K or V holds a value x with head_dim * x^2 >= 2^126, beyond the range where "
                    "norms, q.k and logits stay finite in fp32 (see docs/numerics.md)"};
        }
      }
  return {};
}

/// Whether two blocks of kbytes and vbytes, V's starting `delta` bytes after K's, fit one cell of `pitch` bytes
/// without touching: V inside the gap after K, or K inside the gap after V.
constexpr bool cell_disjoint(Index delta, Index pitch, Index kbytes, Index vbytes) noexcept {
  return (delta >= kbytes && delta <= pitch - vbytes) || (delta <= -vbytes && delta >= kbytes - pitch);
}

/// Whether K and V share memory (compaction would then corrupt one with the other). Views with the same axes
/// (strides and extents; dims may differ) and element size interleave when, at some axis, V's block of the smaller
/// axes lies in the gap K's leaves within that axis' stride (the pitch), or K's in V's: rows of a packed K||V
/// buffer (pitch: the smallest stride), per-head K|V blocks, or K and V pages interleaved in one pool as
/// FlashInfer's [num_pages, 2, page_size, heads, dim] (pitch: stride_page). Distinct cells are a pitch apart, so
/// such views are disjoint. Other views are compared by the address ranges they can touch (bytes_of: strided rows,
/// paged and per-head paged pools, ragged buffers). A view whose rows cannot be known on the host (a device ragged
/// view; a user-defined layout) is caught only when it starts at the other's address. Needs both views validated.
template <class K, class V>
bool views_overlap(K const& keys, V const& values) noexcept {
  RowAxes ka{0, true, {}, {}, {}}, va{0, true, {}, {}, {}};
  if (!view_axes(keys, ka) || !view_axes(values, va))
    return keys.extents().rows() > 0 && values.extents().rows() > 0 &&
           static_cast<void const*>(keys.data()) == static_cast<void const*>(values.data());
  if (ka.empty || va.empty)
    return false;
  Index const ke = sizeof(*keys.data()), ve = sizeof(*values.data());
  auto const k0 = reinterpret_cast<std::uintptr_t>(keys.data()), v0 = reinterpret_cast<std::uintptr_t>(values.data());
  auto const delta = static_cast<Index>(v0 - k0);  // modular: no signed overflow whatever the addresses
  if (ke == ve && ka.count == va.count && std::equal(ka.axis, ka.axis + ka.count, va.axis)) {
    Index low = 0;  // offsets the axes below the pitch add: K's block is low + K's dim
    for (int i = 0; i < ka.count; ++i) {
      if (cell_disjoint(delta, ka.axis[i].stride * ke, (low + ka.dim) * ke, (low + va.dim) * ve))
        return false;
      low += ka.axis[i].stride * (ka.axis[i].extent - 1);
    }
  }
  return overlap(bytes_of(keys), bytes_of(values));
}

}  // namespace detail

/// Checks one K or V view: extents, 64-bit element and byte offsets, non-overlapping rows (an empty view is valid
/// whatever its strides), paged fields >= 0 and tables (host: every page id a valid token uses); lengths in
/// [0, tokens] and, when asked, finiteness and range of every valid element (host views).
template <TokenRowsView R>
Status validate_rows(R const& rows, ValidateOptions opts = {}, Lengths lengths = {}) noexcept {
  KVC_RETURN_IF_ERROR(detail::layout_status(rows.layout()));
  Index bytes = 0;
  if (!checked_product(bytes, detail::layout_span(rows.layout()), Index{sizeof(typename R::value_type)}))
    return {Errc::invalid_argument, "kvc::validate: the bytes a K or V view spans overflow 64 bits"};
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
    if constexpr (std::is_same_v<typename R::layout_type, HeadPagedLayout>)
      KVC_RETURN_IF_ERROR(detail::head_pages_status(rows.layout(), lengths));
    if constexpr (std::is_same_v<typename R::layout_type, RaggedLayout>) {
      KVC_RETURN_IF_ERROR(detail::ragged_status(rows.layout()));
      for (Index b = 0; b < e.batch; ++b)
        for (Index h = 0; h < e.heads; ++h)
          if (lengths.at(b, h, 0) > rows.layout().capacity(b, h))  // no table: every head is full
            return {Errc::invalid_argument, "kvc::validate: a head's valid length passes its ragged segment"};
    }
    if (opts.check_finite || opts.check_range)
      return detail::rows_finite(rows, lengths, opts.check_range);
  }
  return {};
}

/// Checks a host or device cache's shapes and layouts (and, for host caches, its tables and optionally
/// finiteness and range): extents non-negative with dim > 0; K and V agree on batch, heads and tokens; element and
/// byte offsets fit in 64 bits; rows do not overlap; K and V do not overlap (strided or paged; K and V rows or
/// pages interleaved in one buffer are fine). Host caches also: lengths in [0, tokens]; every page id used within
/// the valid lengths inside the pool, CSR lists inside `page_indices`; positions of each head >= 0 and strictly
/// ascending. Device caches' tables are not read (kernels clamp lengths to [0, tokens]).
template <KVCacheView C>
Status validate(C const& cache, ValidateOptions opts = {}) noexcept {
  KVC_RETURN_IF_ERROR(validate_rows(cache.keys, {}, cache.lengths));  // extents first: later checks multiply them
  KVC_RETURN_IF_ERROR(validate_rows(cache.values, {}, cache.lengths));
  KVExtents const k = cache.keys.extents(), v = cache.values.extents();
  if (k.batch != v.batch || k.heads != v.heads || k.tokens != v.tokens)
    return {Errc::invalid_argument, "kvc::validate: keys and values must agree on batch, heads and tokens"};
  if (detail::views_overlap(cache.keys, cache.values))
    return {Errc::invalid_argument, "kvc::validate: K and V memory overlap"};
  if constexpr (HasHeadCapacity<typename C::keys_type::layout_type> &&
                std::is_same_v<typename C::keys_type::layout_type, typename C::values_type::layout_type> &&
                std::is_same_v<typename C::memory_space, HostSpace>) {
    for (Index b = 0; b < k.batch; ++b)  // positions and lengths are per slot of the keys' layout: V must agree
      for (Index h = 0; h < k.heads; ++h)
        if (cache.keys.layout().capacity(b, h) != cache.values.layout().capacity(b, h) ||
            cache.keys.layout().slot(b, h, 0) != cache.values.layout().slot(b, h, 0))
          return {Errc::invalid_argument, "kvc::validate: K and V ragged segments must be the same"};
  }
  if constexpr (std::is_same_v<typename C::memory_space, HostSpace>) {
    if (cache.positions)
      for (Index b = 0; b < k.batch; ++b)
        for (Index h = 0; h < k.heads; ++h)
          for (Index t = 0; t < cache.length(b, h); ++t)
            if (cache.position(b, h, t) < 0 || (t > 0 && cache.position(b, h, t) <= cache.position(b, h, t - 1)))
              return {Errc::invalid_argument, "kvc::validate: positions of a head must be >= 0 and strictly ascending"};
    if (opts.check_finite || opts.check_range) {
      KVC_RETURN_IF_ERROR(detail::rows_finite(cache.keys, cache.lengths, opts.check_range));
      KVC_RETURN_IF_ERROR(detail::rows_finite(cache.values, cache.lengths, opts.check_range));
    }
  }
  return {};
}

}  // namespace kvc
