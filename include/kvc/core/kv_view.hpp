// SPDX-License-Identifier: Apache-2.0
// kvc/core/kv_view.hpp: non-owning views of K or V rows and of a KV cache (keys + values).
#pragma once

#include <kvc/backend/tags.hpp>
#include <kvc/core/element.hpp>
#include <kvc/core/layout.hpp>

#include <concepts>
#include <type_traits>

namespace kvc {

/// Non-owning view of one K *or* V tensor. `T` is float, half or bfloat16 (const for read-only views);
/// `Space` records who may dereference the pointer (HostSpace or DeviceSpace).
template <Element T, TokenLayout Layout, class Space = HostSpace>
class TokenRows {
 public:
  using element_type = T;
  using value_type = std::remove_const_t<T>;
  using layout_type = Layout;
  using memory_space = Space;

  TokenRows() = default;
  KVC_HOST_DEVICE constexpr TokenRows(T* data, Layout const& layout) noexcept : data_(data), layout_(layout) {}

  KVC_HOST_DEVICE constexpr KVExtents const& extents() const noexcept { return layout_.ext; }
  KVC_HOST_DEVICE constexpr Layout const& layout() const noexcept { return layout_; }
  KVC_HOST_DEVICE constexpr T* data() const noexcept { return data_; }
  /// First of `extents().dim` contiguous elements of row (b, h, t).
  KVC_HOST_DEVICE constexpr T* row(Index b, Index h, Index t) const noexcept { return data_ + layout_.offset(b, h, t); }

 private:
  T* data_ = nullptr;
  Layout layout_{};
};

template <class R>
concept TokenRowsView = std::is_trivially_copyable_v<R> && requires(R const& r, Index i) {
  typename R::element_type;
  typename R::memory_space;
  { r.extents() } -> std::convertible_to<KVExtents>;
  { r.row(i, i, i) } -> std::same_as<typename R::element_type*>;
};

/// A KV cache: keys and values with independent layouts and element types in one memory space.
/// `values.extents().dim` may differ from `keys.extents().dim` (d_v != d_k); batch, heads and tokens match.
/// `lengths` (optional, [batch], same memory space) holds each sequence's valid length for ragged batches;
/// tokens at or beyond it are padding: never scored as keepable, never kept, never attended.
template <TokenRowsView K, TokenRowsView V>
requires std::same_as<typename K::memory_space, typename V::memory_space>
struct KVCache {
  using memory_space = typename K::memory_space;
  using keys_type = K;
  using values_type = V;

  K keys;
  V values;
  Index const* lengths = nullptr;

  /// Valid tokens of sequence b (host-space caches only).
  constexpr Index length(Index b) const noexcept { return lengths ? lengths[b] : keys.extents().tokens; }
};

template <class C>
concept KVCacheView = requires(C const& c) {
  typename C::memory_space;
  requires TokenRowsView<std::remove_cvref_t<decltype(c.keys)>>;
  requires TokenRowsView<std::remove_cvref_t<decltype(c.values)>>;
  { c.lengths } -> std::convertible_to<Index const*>;
};

/// Whether backend B can read cache C (the memory spaces match). Checked at compile time by every entry point.
template <class C, class B>
concept AccessibleFrom =
    KVCacheView<C> && Backend<B> && std::same_as<typename C::memory_space, typename B::memory_space>;

/// Builds a cache from two row views (deduces the types).
template <TokenRowsView K, TokenRowsView V>
constexpr KVCache<K, V> make_cache(K keys, V values, Index const* lengths = nullptr) noexcept {
  return {keys, values, lengths};
}

/// Contiguous BHTD rows over host memory: the common case in tests, tools and the Hugging Face layout.
template <Element T>
constexpr TokenRows<T, StridedLayout> bhtd_rows(T* data, KVExtents e) noexcept {
  return {data, bhtd_layout(e)};
}

/// Same as bhtd_rows, for device memory.
template <Element T>
constexpr TokenRows<T, StridedLayout, DeviceSpace> bhtd_device_rows(T* data, KVExtents e) noexcept {
  return {data, bhtd_layout(e)};
}

/// A dense BHTD cache over host K and V buffers (no copy). `dim_v` defaults to `e.dim`.
template <Element TK, Element TV>
constexpr auto dense_cache(TK* k, TV* v, KVExtents e, Index dim_v = -1, Index const* lengths = nullptr) noexcept {
  KVExtents ev = e;
  ev.dim = dim_v < 0 ? e.dim : dim_v;
  return make_cache(bhtd_rows(k, e), bhtd_rows(v, ev), lengths);
}

}  // namespace kvc
