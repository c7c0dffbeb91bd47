// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/knorm.hpp: CPU reference kernel for KnormScorer.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/scorers/knorm.hpp>

#include <cmath>
#include <cstddef>
#include <type_traits>

namespace kvc {

/// One pass over K; fp32 sums of squares in fixed-order lanes (detail::dot).
template <>
struct ScoreKernel<KnormScorer, Cpu> {
  /// One fp32 row to widen 16-bit keys (float keys need none, but the query stays type-independent).
  static std::size_t workspace_bytes(KnormScorer const&, KVExtents const& keys) {
    return workspace_round(static_cast<std::size_t>(keys.dim) * sizeof(float));
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const&, KnormScorer const&, C const& cache, Obs const&, ScoreSpan<HostSpace> out,
                    Workspace ws) {
    auto const& keys = cache.keys;
    KVExtents const e = keys.extents();
    constexpr bool widen = !std::is_same_v<typename std::remove_cvref_t<decltype(keys)>::value_type, float>;
    float* scratch = WorkspaceCarver(ws).take<float>(widen ? e.dim : 0);  // only 16-bit rows need scratch
    if (scratch == nullptr && widen && e.dim > 0)
      return {Errc::out_of_capacity, "kvc::score(knorm): workspace smaller than score_workspace_bytes()"};
    return detail::for_each_head(out, [&](Index b, Index h, Index n, float* score) {
      for (Index t = 0; t < n; ++t) {
        float const* k = detail::float_row(keys.row(b, h, t), e.dim, scratch).data();
        score[t] = -std::sqrt(detail::dot(k, k, e.dim));
      }
    });
  }
};

}  // namespace kvc
