// SPDX-License-Identifier: Apache-2.0
// kvc/core/kv_view.hpp: non-owning views of K or V rows and of a KV cache (keys, values, lengths, positions).
#pragma once

#include <kvc/core/access.hpp>
#include <kvc/core/backend.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/status.hpp>

#include <concepts>
#include <type_traits>
#include <utility>

namespace kvc {

/// Non-owning view of one K *or* V tensor. `T` is float, half, bfloat16 or an 8-bit float (const for read-only
/// views); `Space` records who may dereference the pointer (HostSpace or DeviceSpace); `Access` turns stored elements
/// into fp32 values (core/access.hpp: element c of row (b, h, t) is load(row(b, h, t)[c], scale(b, h)); fp8 views
/// carry their scales). A mutable view converts to a read-only one.
template <CacheElement T, TokenLayout Layout, class Space = HostSpace, class Access = default_access<T>>
class TokenRows {
 public:
  using element_type = T;
  using value_type = std::remove_const_t<T>;
  using layout_type = Layout;
  using memory_space = Space;
  using access_type = Access;

  TokenRows() = default;
  KVC_HOST_DEVICE constexpr TokenRows(T* data, Layout const& layout, Access const& access = {}) noexcept
      : data_(data), layout_(layout), access_(access) {}
  template <class U>
  requires(std::is_const_v<T>&& std::same_as<U const, T>)
      KVC_HOST_DEVICE constexpr TokenRows(TokenRows<U, Layout, Space, Access> const& other) noexcept  // NOLINT
      : data_(other.data()), layout_(other.layout()), access_(other.access()) {}

  KVC_HOST_DEVICE constexpr KVExtents const& extents() const noexcept { return layout_.ext; }
  KVC_HOST_DEVICE constexpr Layout const& layout() const noexcept { return layout_; }
  KVC_HOST_DEVICE constexpr Access const& access() const noexcept { return access_; }
  KVC_HOST_DEVICE constexpr T* data() const noexcept { return data_; }
  /// First of `extents().dim` contiguous elements of row (b, h, t).
  KVC_HOST_DEVICE constexpr T* row(Index b, Index h, Index t) const noexcept { return data_ + layout_.offset(b, h, t); }
  /// The scale of head (b, h)'s elements: kvc::Unit for unscaled views, an fp32 value for scaled ones.
  KVC_HOST_DEVICE constexpr auto scale(Index b, Index h) const noexcept { return access_.scale(b, h); }

 private:
  T* data_ = nullptr;
  Layout layout_{};
  [[no_unique_address]] Access access_{};
};

template <class R>
concept TokenRowsView = std::is_trivially_copyable_v<R> && requires(R const& r, Index i) {
  typename R::element_type;
  typename R::memory_space;
  { r.extents() } -> std::convertible_to<KVExtents>;
  { r.row(i, i, i) } -> std::same_as<typename R::element_type*>;
  { load(*r.row(i, i, i), r.scale(i, i)) } -> std::same_as<float>;
};

/// Whether a view's elements carry a scale (fp8 caches).
template <TokenRowsView R>
inline constexpr bool scaled_rows = !std::is_same_v<decltype(std::declval<R const&>().scale(0, 0)), Unit>;

/// Valid token counts of a cache, in the cache's memory space: per (sequence, KV head) `[batch, heads]` (heads
/// differ after per-head eviction), per sequence `[batch]` (the convenient special case: every head of sequence b
/// holds data[b] tokens), or absent (every head holds `tokens`, the capacity). Slots at or past a head's length
/// are padding: never scored as keepable, never kept, never attended. kvc::compact and kvc::append write the table.
struct Lengths {
  Index* data = nullptr;
  Index heads = 0;  ///< 0: per sequence (data[b]); > 0: per head (data[b * heads + h])

  constexpr Lengths() noexcept = default;
  /// Per-sequence lengths [batch] (implicit, so a plain pointer reads as before).
  KVC_HOST_DEVICE constexpr Lengths(Index* per_sequence) noexcept : data(per_sequence) {}  // NOLINT: implicit
  KVC_HOST_DEVICE constexpr Lengths(Index* table, Index kv_heads) noexcept : data(table), heads(kv_heads) {}

  KVC_HOST_DEVICE constexpr bool per_head() const noexcept { return heads > 0; }
  /// Valid tokens of head (b, h) of a cache with `capacity` token slots.
  KVC_HOST_DEVICE constexpr Index at(Index b, Index h, Index capacity) const noexcept {
    return data == nullptr ? capacity : data[heads > 0 ? b * heads + h : b];
  }
};

/// Per-(sequence, KV head) lengths: `table` is [batch, kv_heads].
KVC_HOST_DEVICE constexpr Lengths head_lengths(Index* table, Index kv_heads) noexcept {
  return {table, kv_heads};
}

/// A per-token array [batch, heads, tokens] (contiguous) that travels with the cache's slots: positions, or a
/// stateful policy's accumulator. kvc::compact and kvc::gather move its entries with the same plan as K and V.
template <class T, class Space = HostSpace>
struct TokenArray {
  using memory_space = Space;
  using value_type = T;

  T* data = nullptr;
  Index batch = 0;
  Index heads = 0;
  Index tokens = 0;

  KVC_HOST_DEVICE constexpr T* row(Index b, Index h) const noexcept { return data + (b * heads + h) * tokens; }
  KVC_HOST_DEVICE constexpr T& operator()(Index b, Index h, Index t) const noexcept { return row(b, h)[t]; }
};

/// A KV cache: keys and values with independent layouts and element types in one memory space, plus what an
/// engine keeps beside them. `values.extents().dim` may differ from `keys.extents().dim` (d_v != d_k); batch,
/// heads and tokens (capacity) match.
///  - `lengths`: valid tokens per (sequence, KV head) or per sequence (see Lengths); absent = capacity.
///  - `positions` (optional, [batch, heads, tokens] contiguous): each slot's absolute token position, read by the
///    causal mask of attention and by RoPE re-rotation; absent = slot t holds position t. Compaction, gather and
///    append keep it in step with K and V. Positions of one head are strictly ascending.
/// All pointers live in the cache's memory space. The view is shallow: a const KVCache still writes through.
template <TokenRowsView K, TokenRowsView V>
requires std::same_as<typename K::memory_space, typename V::memory_space>
struct KVCache {
  using memory_space = typename K::memory_space;
  using keys_type = K;
  using values_type = V;

  K keys;
  V values;
  Lengths lengths{};
  Index* positions = nullptr;

  KVC_HOST_DEVICE constexpr Index tokens() const noexcept { return keys.extents().tokens; }
  /// Valid tokens of head (b, h) (readable where the memory space is); without a table, the head's capacity.
  KVC_HOST_DEVICE constexpr Index length(Index b, Index h) const noexcept { return lengths.at(b, h, capacity(b, h)); }
  /// Token slots head (b, h) can hold: its segment in a ragged layout, `tokens()` otherwise.
  KVC_HOST_DEVICE constexpr Index capacity(Index b, Index h) const noexcept {
    return head_capacity(keys.layout(), b, h);
  }
  /// length(b, h) clamped to [0, capacity(b, h)]: what device kernels read, since device length tables are not
  /// validated and a ragged head must never read into the next head's segment or past the buffer.
  KVC_HOST_DEVICE constexpr Index clamped_length(Index b, Index h) const noexcept {
    Index const n = length(b, h), cap = capacity(b, h);
    return n < 0 ? 0 : (n > cap ? cap : n);
  }
  /// Where slot t of head (b, h) keeps its position: [batch, heads, tokens] contiguous, or for layouts that number
  /// their rows (ragged, per-head paged) the row's number, so positions are as ragged as the rows.
  KVC_HOST_DEVICE constexpr Index position_slot(Index b, Index h, Index t) const noexcept {
    if constexpr (requires { keys.layout().slot(b, h, t); })
      return keys.layout().slot(b, h, t);
    else
      return (b * keys.extents().heads + h) * tokens() + t;
  }
  /// Absolute position of slot t of head (b, h).
  KVC_HOST_DEVICE constexpr Index position(Index b, Index h, Index t) const noexcept {
    return positions ? positions[position_slot(b, h, t)] : t;
  }
  /// The stored position of slot t of head (b, h), to write (`positions` must be non-null).
  KVC_HOST_DEVICE constexpr Index& position_ref(Index b, Index h, Index t) const noexcept {
    return positions[position_slot(b, h, t)];
  }

  /// A read-only view of the same cache.
  template <TokenRowsView K2, TokenRowsView V2>
  requires(std::is_convertible_v<K, K2>&& std::is_convertible_v<V, V2>) constexpr operator KVCache<K2, V2>()
      const noexcept {  // NOLINT: implicit, like span<T> -> span<T const>
    return {K2(keys), V2(values), lengths, positions};
  }
};

template <class C>
concept KVCacheView = requires(C const& c, Index i) {
  typename C::memory_space;
  requires TokenRowsView<std::remove_cvref_t<decltype(c.keys)>>;
  requires TokenRowsView<std::remove_cvref_t<decltype(c.values)>>;
  { c.length(i, i) } -> std::same_as<Index>;
  { c.position(i, i, i) } -> std::same_as<Index>;
};

/// One past the largest position held by any head of sequence b (0 for an empty sequence): queries given without
/// positions are taken to be the last ones of the context, query i of n at context_end - n + i. Positions of a
/// head ascend, so only each head's last valid slot is read.
template <KVCacheView C>
KVC_HOST_DEVICE constexpr Index context_end(C const& cache, Index b) noexcept {
  Index end = 0;
  for (Index h = 0; h < cache.keys.extents().heads; ++h) {
    Index const n = cache.clamped_length(b, h);  // device tables are not validated: never read past the buffer
    Index const last = n > 0 ? cache.position(b, h, n - 1) + 1 : 0;
    end = last > end ? last : end;
  }
  return end;
}

/// Slots of head (b, h) whose position is before `position`: positions ascend, so they are a prefix of the valid
/// slots, found by binary search (the window keys of SnapKV and TOVA start there).
template <KVCacheView C>
KVC_HOST_DEVICE constexpr Index slots_before(C const& cache, Index b, Index h, Index position) noexcept {
  Index lo = 0, hi = cache.clamped_length(b, h);
  while (lo < hi) {
    Index const mid = lo + (hi - lo) / 2;
    if (cache.position(b, h, mid) < position)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// Checks a length table's shape against a cache of `heads` KV heads (host-side fields only, so every backend can
/// call it): a per-head table must have been built for exactly that many heads.
constexpr Status check_length_table(Lengths const& lengths, Index heads, char const* what) noexcept {
  return lengths.data && lengths.per_head() && lengths.heads != heads ? Status{Errc::invalid_argument, what} : Status{};
}

/// Whether backend B can read cache C: the memory spaces match. Checked at compile time by every entry point.
template <class C, class B>
concept AccessibleFrom = KVCacheView<C> && ReadableBy<C, B>;

/// Builds a cache from two row views (deduces the types).
template <TokenRowsView K, TokenRowsView V>
constexpr KVCache<K, V> make_cache(K keys, V values, Lengths lengths = {}, Index* positions = nullptr) noexcept {
  return {keys, values, lengths, positions};
}

/// Contiguous BHTD rows over host memory: the common case in tests, tools and the Hugging Face layout. fp8 rows take
/// their scales (core/access.hpp; default: one scale of 1).
template <CacheElement T>
constexpr TokenRows<T, StridedLayout> bhtd_rows(T* data, KVExtents e, default_access<T> const& access = {}) noexcept {
  return {data, bhtd_layout(e), access};
}

/// Same as bhtd_rows, for device memory.
template <CacheElement T>
constexpr TokenRows<T, StridedLayout, DeviceSpace> bhtd_device_rows(T* data, KVExtents e,
                                                                    default_access<T> const& access = {}) noexcept {
  return {data, bhtd_layout(e), access};
}

/// A dense BHTD cache over host K and V buffers of the same head dim (no copy).
template <Element TK, Element TV>
constexpr auto dense_cache(TK* k, TV* v, KVExtents e, Lengths lengths = {}, Index* positions = nullptr) noexcept {
  return make_cache(bhtd_rows(k, e), bhtd_rows(v, e), lengths, positions);
}

/// A dense BHTD cache whose values have head dim `dim_v` (d_v != d_k).
template <Element TK, Element TV>
constexpr auto dense_cache(TK* k, TV* v, KVExtents e, Index dim_v, Lengths lengths = {},
                           Index* positions = nullptr) noexcept {
  KVExtents ev = e;
  ev.dim = dim_v;
  return make_cache(bhtd_rows(k, e), bhtd_rows(v, ev), lengths, positions);
}

}  // namespace kvc
