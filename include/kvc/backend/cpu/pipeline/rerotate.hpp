// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/pipeline/rerotate.hpp: CPU kernel of kvc::rerotate_keys.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/pipeline/rerotate.hpp>

#include <algorithm>
#include <cstddef>

namespace kvc {

/// Each key is widened, rotated back from its position (inverse rotation) and forward to its slot with the table's
/// cos/sin (no trigonometry per element), then narrowed. Rows already at their slot are left untouched, bit for bit.
template <>
struct Kernel<RerotateStep, Cpu> {
  static constexpr Index max_dim = 1024;  // one stack row; larger head dims are rejected

  template <KVCacheView C>
  static Status run(Cpu const& cpu, RopeTable<HostSpace> const& table, C const& cache) {
    using T = typename C::keys_type::value_type;
    KVExtents const e = cache.keys.extents();
    if (e.dim > max_dim)
      return {Errc::invalid_argument, "kvc::rerotate_keys: head dim must be <= 1024"};
    KVC_RETURN_IF_ERROR(detail::check_lengths(cache.lengths, e.batch, e.heads, e.tokens,
                                              "kvc::rerotate_keys: every valid length must be in [0, tokens]"));
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h) {
        Index const n = cache.length(b, h);
        if (n > 0)
          KVC_RETURN_IF_ERROR(check_rope_table(table, e.dim, std::max(cache.position(b, h, n - 1), n - 1)));
      }
    detail::parallel_for(cpu, e.batch * e.heads, [&](Index item, Index) {
      Index const b = item / e.heads, h = item % e.heads;
      float row[max_dim];
      for (Index j = 0; j < cache.length(b, h); ++j) {
        Index const from = cache.position(b, h, j);
        if (from == j)
          continue;
        T* k = cache.keys.row(b, h, j);
        auto const scale = cache.keys.scale(b, h);  // a scaled (fp8) key is rounded again under its scale
        for (Index i = 0; i < e.dim; ++i)
          row[i] = load(k[i], scale);
        table.rotate(row, from, /*inverse=*/true);
        table.rotate(row, j);
        for (Index i = 0; i < e.dim; ++i)
          k[i] = store<T>(row[i], scale);
        if (cache.positions)
          cache.position_ref(b, h, j) = j;
      }
    });
    return {};
  }
};

}  // namespace kvc
