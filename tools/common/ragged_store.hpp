// SPDX-License-Identifier: Apache-2.0
// tools/common/ragged_store.hpp: an owning host ragged per-head store (K, V, offsets, lengths, positions) for the
// tools and tests; the library's view of it is kvc::ragged_cache (include/kvc/store/ragged.hpp).
#pragma once

#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/store/ragged.hpp>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace kvc::tools {

template <class T>
struct HostRaggedStore {
  Index batch = 0, heads = 0, dim = 0, dim_v = 0;
  RaggedShape shape;
  std::vector<Index> offsets;                ///< [batch * heads + 1]
  std::vector<Index> lengths;                ///< [batch, heads], valid tokens
  std::vector<Index> positions;              ///< [shape.rows], one per row
  std::vector<T> k, v;                       ///< [shape.rows, dim], [shape.rows, dim_v]
  default_access<T> k_access{}, v_access{};  ///< fp8: the scales of the cache the store holds (appends move bytes)

  HostRaggedStore() = default;
  /// Head i = b * heads + h gets room for counts[i] + reserve tokens; every head starts empty.
  HostRaggedStore(Index b, Index h, Index d, Index dv, Index const* counts, Index reserve)
      : batch(b),
        heads(h),
        dim(d),
        dim_v(dv),
        offsets(static_cast<std::size_t>(b * h + 1)),
        lengths(static_cast<std::size_t>(b * h), 0) {
    if (auto const st = ragged_offsets(counts, b * h, reserve, offsets.data(), shape); !st.ok())
      throw std::invalid_argument(st.message());
    positions.assign(static_cast<std::size_t>(shape.rows), 0);
    k.resize(static_cast<std::size_t>(shape.rows * d));
    v.resize(static_cast<std::size_t>(shape.rows * dv));
  }
  /// Room for every head's current length plus `reserve` (the counts of a re-layout).
  Index capacity(Index b, Index h) const { return offsets[b * heads + h + 1] - offsets[b * heads + h]; }

  auto view() {
    return ragged_cache(k.data(), v.data(), batch, heads, dim, dim_v, shape, offsets.data(),
                        head_lengths(lengths.data(), heads), positions.data(), k_access, v_access);
  }
  auto view() const {
    return ragged_cache(static_cast<T const*>(k.data()), static_cast<T const*>(v.data()), batch, heads, dim, dim_v,
                        shape, offsets.data(), head_lengths(const_cast<Index*>(lengths.data()), heads),
                        const_cast<Index*>(positions.data()), k_access, v_access);
  }
};

/// A copy of `store` with every head's current tokens and `reserve` free slots each (kvc::append of the whole store
/// into an empty one: the authors' decode re-layout, once per `reserve` tokens).
template <class T>
HostRaggedStore<T> relayout(HostRaggedStore<T>& store, Index reserve) {
  HostRaggedStore<T> out(store.batch, store.heads, store.dim, store.dim_v, store.lengths.data(), reserve);
  out.k_access = store.k_access;
  out.v_access = store.v_access;
  if (auto const st = append(Cpu{}, out.view(), store.view()); !st.ok())
    throw std::logic_error(std::string("kvc: ragged re-layout failed: ") + st.message());
  return out;
}

}  // namespace kvc::tools
