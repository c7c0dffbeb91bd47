// SPDX-License-Identifier: Apache-2.0
// kvc/core/layout.hpp: token layouts, mdspan-style mappings from (batch, head, token) to an element offset.
//
// A layout says where the row of `dim` contiguous elements for (b, h, t) starts. Scorers, selectors and
// compaction only ever call `offset`, so they never see strides or block tables.
#pragma once

#include <kvc/core/extents.hpp>

#include <concepts>
#include <cstdint>
#include <type_traits>

namespace kvc {

/// Dense rows at arbitrary strides (in elements). Covers BHTD (Hugging Face), BTHD (flash-attn, llama.cpp and
/// SGLang token-major) and slices of larger buffers (e.g. a packed K||V innermost layout).
struct StridedLayout {
  KVExtents ext;
  Index stride_b = 0;
  Index stride_h = 0;
  Index stride_t = 0;

  KVC_HOST_DEVICE constexpr Index offset(Index b, Index h, Index t) const noexcept {
    return b * stride_b + h * stride_h + t * stride_t;
  }
};

// The constructors below multiply caller-given extents: they use saturating_product (extents.hpp), so extents whose
// element count overflows give a saturated stride, never a signed overflow, and kvc::validate and every entry point
// reject them (extents_fit) before an offset is computed.

/// Contiguous [batch, heads, tokens, dim] (the Hugging Face cache layout).
constexpr StridedLayout bhtd_layout(KVExtents e) noexcept {
  return {e, saturating_product(e.heads, e.tokens, e.dim), saturating_product(e.tokens, e.dim), e.dim};
}

/// Contiguous [batch, tokens, heads, dim] (flash-attn, token-major engines).
constexpr StridedLayout bthd_layout(KVExtents e) noexcept {
  return {e, saturating_product(e.tokens, e.heads, e.dim), e.dim, saturating_product(e.heads, e.dim)};
}

/// Where a token's row sits inside one page.
enum class PageOrder : std::uint8_t {
  nhd,  ///< page = [page_size, heads, dim] (vLLM flash-attn, FlashInfer default)
  hnd,  ///< page = [heads, page_size, dim] (TRT-LLM, MLC/TVM, FlashInfer option)
};

/// Fixed-size pages of one sequence found through a page list: either a padded block table
/// (`block_table[b * max_pages + p]`, vLLM) or CSR (`page_indices[page_indptr[b] + p]`, FlashInfer/MLC).
/// Page ids are int32 as every engine stores them. Tables live in the same memory space as the data.
/// `ext.tokens` is the largest sequence length the tables can address. `num_pages` is the pool's size and
/// `num_page_indices` the CSR index array's declared size: kvc::validate checks every page id used within the
/// valid lengths against them (host tables).
struct PagedLayout {
  KVExtents ext;
  Index page_size = 0;
  Index stride_page = 0;                      ///< elements between consecutive pages in the pool
  Index stride_h = 0;                         ///< inside a page
  Index stride_t = 0;                         ///< inside a page
  std::int32_t const* block_table = nullptr;  ///< [batch, max_pages], used when page_indptr is null
  Index max_pages = 0;
  std::int32_t const* page_indptr = nullptr;   ///< [batch + 1] (CSR mode)
  std::int32_t const* page_indices = nullptr;  ///< [num_page_indices] (CSR mode)
  Index num_pages = 0;                         ///< pages in the pool: valid ids are [0, num_pages)
  Index num_page_indices = 0;                  ///< entries of page_indices (CSR mode)

  KVC_HOST_DEVICE constexpr Index page_of(Index b, Index t) const noexcept {
    Index const p = t / page_size;
    return page_indptr ? Index{page_indices[page_indptr[b] + p]} : Index{block_table[b * max_pages + p]};
  }
  KVC_HOST_DEVICE constexpr Index offset(Index b, Index h, Index t) const noexcept {
    return page_of(b, t) * stride_page + h * stride_h + (t % page_size) * stride_t;
  }
};

/// A paged layout over a pool of `num_pages` [page] blocks with a padded block table [batch, max_pages].
constexpr PagedLayout paged_layout(KVExtents e, Index page_size, PageOrder order, std::int32_t const* block_table,
                                   Index max_pages, Index num_pages) noexcept {
  PagedLayout l{e,         page_size, saturating_product(page_size, e.heads, e.dim),
                0,         0,         block_table,
                max_pages, nullptr,   nullptr,
                num_pages, 0};
  l.stride_h = order == PageOrder::nhd ? e.dim : saturating_product(page_size, e.dim);
  l.stride_t = order == PageOrder::nhd ? saturating_product(e.heads, e.dim) : e.dim;
  return l;
}

/// A paged layout over a pool of `num_pages` pages with CSR page lists (indptr [batch + 1], indices [num_indices]).
constexpr PagedLayout paged_layout_csr(KVExtents e, Index page_size, PageOrder order, std::int32_t const* indptr,
                                       std::int32_t const* indices, Index num_indices, Index num_pages) noexcept {
  PagedLayout l = paged_layout(e, page_size, order, nullptr, 0, num_pages);
  l.page_indptr = indptr;
  l.page_indices = indices;
  l.num_page_indices = num_indices;
  return l;
}

/// Ragged rows per (sequence, KV head) in one flattened buffer of rows (the AdaKV authors' layout): head (b, h) owns
/// rows [offsets[i], offsets[i + 1]) with i = b * heads + h, so each head holds exactly its own tokens (plus any
/// reserve the engine sized in). `offsets` is [batch * heads + 1], non-decreasing, offsets[0] = 0, in the memory
/// space of the data; `ext.tokens` is the largest head capacity (slot t < capacity(b, h) of each head is valid
/// storage). Rows are `stride_t` elements apart (>= dim). Per-token arrays of a ragged cache (positions) are indexed
/// by `slot(b, h, t)`, the row's number in the buffer, so they are ragged too.
struct RaggedLayout {
  KVExtents ext;
  Index stride_t = 0;
  Index const* offsets = nullptr;

  KVC_HOST_DEVICE constexpr Index slot(Index b, Index h, Index t) const noexcept {
    return offsets[b * ext.heads + h] + t;
  }
  KVC_HOST_DEVICE constexpr Index offset(Index b, Index h, Index t) const noexcept { return slot(b, h, t) * stride_t; }
  /// Token slots head (b, h) owns.
  KVC_HOST_DEVICE constexpr Index capacity(Index b, Index h) const noexcept {
    Index const i = b * ext.heads + h;
    return offsets[i + 1] - offsets[i];
  }
  /// Rows of the whole buffer (offsets[batch * heads]).
  KVC_HOST_DEVICE constexpr Index rows() const noexcept { return offsets[ext.batch * ext.heads]; }
};

/// A ragged layout of rows `dim` elements apart over `offsets` ([batch * heads + 1]); `max_capacity` is the largest
/// segment (ext.tokens).
constexpr RaggedLayout ragged_layout(Index batch, Index heads, Index dim, Index max_capacity,
                                     Index const* offsets) noexcept {
  return {{batch, heads, max_capacity, dim}, dim, offsets};
}

/// One page list per (sequence, KV head): a page holds `page_size` rows of one head ([page_size, dim]), so a paged
/// engine frees pages per head after per-head eviction. `block_table` is [batch * heads, max_pages] int32 page ids
/// (row b * heads + h lists head (b, h)'s pages in token order); `ext.tokens` = max_pages * page_size is each head's
/// capacity as far as the table goes (the engine maps a page before a head's length enters it). Per-token arrays
/// (positions) are indexed by `slot(b, h, t)` = page * page_size + t % page_size, parallel to the pool.
struct HeadPagedLayout {
  KVExtents ext;
  Index page_size = 0;
  Index stride_page = 0;  ///< elements between consecutive pages in the pool
  Index stride_t = 0;     ///< elements between rows inside a page (>= dim)
  std::int32_t const* block_table = nullptr;
  Index max_pages = 0;
  Index num_pages = 0;  ///< pages in the pool: valid ids are [0, num_pages)

  KVC_HOST_DEVICE constexpr Index page_of(Index b, Index h, Index t) const noexcept {
    return block_table[(b * ext.heads + h) * max_pages + t / page_size];
  }
  KVC_HOST_DEVICE constexpr Index slot(Index b, Index h, Index t) const noexcept {
    return page_of(b, h, t) * page_size + t % page_size;
  }
  KVC_HOST_DEVICE constexpr Index offset(Index b, Index h, Index t) const noexcept {
    return page_of(b, h, t) * stride_page + (t % page_size) * stride_t;
  }
};

/// Per-head pages of `page_size` contiguous rows over a pool of `num_pages` pages.
constexpr HeadPagedLayout head_paged_layout(Index batch, Index heads, Index dim, Index page_size,
                                            std::int32_t const* block_table, Index max_pages,
                                            Index num_pages) noexcept {
  return {{batch, heads, saturating_product(max_pages, page_size), dim},
          page_size,
          saturating_product(page_size, dim),
          dim,
          block_table,
          max_pages,
          num_pages};
}

/// Layouts whose heads own different numbers of slots (RaggedLayout).
template <class L>
concept HasHeadCapacity = requires(L const& l, Index i) {
  { l.capacity(i, i) } -> std::same_as<Index>;
};

/// Token slots head (b, h) of a layout can hold: the head's segment for ragged layouts, ext.tokens otherwise.
template <class L>
KVC_HOST_DEVICE constexpr Index head_capacity(L const& l, Index b, Index h) noexcept {
  if constexpr (HasHeadCapacity<L>)
    return l.capacity(b, h);
  else
    return l.ext.tokens;
}

/// A token layout is a small copyable mapping with extents and an element offset for (b, h, t).
template <class L>
concept TokenLayout = std::is_trivially_copyable_v<L> && requires(L const& l, Index i) {
  { l.ext } -> std::convertible_to<KVExtents>;
  { l.offset(i, i, i) } -> std::same_as<Index>;
};

static_assert(TokenLayout<StridedLayout> && TokenLayout<PagedLayout> && TokenLayout<RaggedLayout> &&
              TokenLayout<HeadPagedLayout>);

}  // namespace kvc
