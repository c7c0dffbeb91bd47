// SPDX-License-Identifier: Apache-2.0
// kvc/store/ragged.hpp: ragged per-head stores (each (sequence, KV head) holds exactly its kept tokens) and the
// memory they hold.
//
// A store is a KVCache whose layouts are RaggedLayout (the AdaKV authors' flattened rows with per-head offsets) or
// HeadPagedLayout (one page list per head), so every entry point runs on it unchanged: kvc::gather fills it from any
// cache with a plan (each head receives its own count), kvc::append adds decode tokens after each head's length
// (within its segment: no reallocation while the reserve lasts; a full head is an error on the CPU, clamped on
// CUDA), kvc::compact compacts each head in place at later compressions, kvc::attend attends over it (every head its
// own length, GQA groups sharing a KV head), and positions are stored per row (KVCache::position_slot).
// To grow or shrink a ragged store, append the whole store into a new one with empty lengths: the authors' decode
// re-layout (FFY0/AdaKV csrc/csrc/cuda_api.cu: head h's rows move to offset cu[h] + h), done once per `reserve` tokens
// instead of every step.
#pragma once

#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kv_view.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/status.hpp>
#include <kvc/store/pages.hpp>

#include <type_traits>

namespace kvc {

/// The size of a ragged buffer: rows in all (offsets[last]) and the largest head segment (the layout's ext.tokens).
struct RaggedShape {
  Index rows = 0;
  Index max_capacity = 0;
};

/// Host offsets for heads that hold counts[i] tokens plus `reserve` free slots each: offsets[0] = 0,
/// offsets[i + 1] = offsets[i] + counts[i] + reserve, for i in [0, n) (n = batch * heads; `offsets` has n + 1
/// entries). Errors: a negative count or reserve, or a total beyond 2^62 rows.
inline Status ragged_offsets(Index const* counts, Index n, Index reserve, Index* offsets, RaggedShape& shape) noexcept {
  if (n < 0 || reserve < 0 || (n > 0 && (counts == nullptr || offsets == nullptr)))
    return {Errc::invalid_argument, "kvc::ragged_offsets: need n >= 0, reserve >= 0 and non-null counts and offsets"};
  shape = {};
  offsets[0] = 0;
  for (Index i = 0; i < n; ++i) {
    if (counts[i] < 0 || counts[i] > (Index{1} << 62) - reserve - offsets[i])
      return {Errc::invalid_argument, "kvc::ragged_offsets: counts must be >= 0 and their total below 2^62"};
    Index const cap = counts[i] + reserve;
    offsets[i + 1] = offsets[i] + cap;
    shape.max_capacity = cap > shape.max_capacity ? cap : shape.max_capacity;
  }
  shape.rows = offsets[n];
  return {};
}

/// A ragged cache over K rows [shape.rows, dim_k] and V rows [shape.rows, dim_v] (contiguous, in memory space
/// `Space`) sharing `offsets` ([batch * heads + 1]), with a per-head length table and optional positions
/// ([shape.rows], one per row). fp8 rows take their scales (core/access.hpp): give the store its cache's, so that
/// appending moves bytes.
template <class Space = HostSpace, CacheElement TK, CacheElement TV>
constexpr auto ragged_cache(TK* k, TV* v, Index batch, Index heads, Index dim_k, Index dim_v, RaggedShape shape,
                            Index const* offsets, Lengths lengths, Index* positions = nullptr,
                            default_access<TK> const& k_access = {}, default_access<TV> const& v_access = {}) noexcept {
  return make_cache(
      TokenRows<TK, RaggedLayout, Space>{k, ragged_layout(batch, heads, dim_k, shape.max_capacity, offsets), k_access},
      TokenRows<TV, RaggedLayout, Space>{v, ragged_layout(batch, heads, dim_v, shape.max_capacity, offsets), v_access},
      lengths, positions);
}

/// Bytes a host cache holds for K, V and positions, against what its tokens would need in a uniform cache.
struct StoreReport {
  Index held_bytes = 0;     ///< allocated to the cache: uniform: batch·heads·tokens rows; ragged: every segment;
                            ///< per-head paged: the pages the heads' lengths use
  Index used_bytes = 0;     ///< the valid tokens' rows
  Index uniform_bytes = 0;  ///< a uniform cache holding the same tokens: batch·heads·(longest head) rows
  Index row_bytes = 0;      ///< one token of one head: K row + V row (+ its position)
};

/// Reads a host cache's lengths (and ragged offsets); trusts a cache that passed kvc::validate.
template <KVCacheView C>
StoreReport store_report(C const& cache) noexcept {
  static_assert(std::is_same_v<typename C::memory_space, HostSpace>, "kvc::store_report reads host tables");
  using L = typename C::keys_type::layout_type;
  KVExtents const e = cache.keys.extents();
  StoreReport r;
  r.row_bytes = e.dim * Index{sizeof(typename C::keys_type::value_type)} +
                cache.values.extents().dim * Index{sizeof(typename C::values_type::value_type)} +
                (cache.positions ? Index{sizeof(Index)} : 0);
  Index held = 0, used = 0;
  for (Index b = 0; b < e.batch; ++b) {
    Index longest = 0;
    for (Index h = 0; h < e.heads; ++h) {
      Index const n = cache.length(b, h);
      used += n;
      longest = n > longest ? n : longest;
      if constexpr (std::is_same_v<L, HeadPagedLayout>) {
        Index const ps = cache.keys.layout().page_size;
        held += (n + ps - 1) / ps * ps;
      } else {
        held += cache.capacity(b, h);
      }
    }
    r.uniform_bytes += longest * e.heads * r.row_bytes;
  }
  r.held_bytes = held * r.row_bytes;
  r.used_bytes = used * r.row_bytes;
  return r;
}

}  // namespace kvc
