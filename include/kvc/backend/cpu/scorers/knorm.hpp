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

/// One pass over K; fp32 sums of squares in fixed-order lanes, 16-bit keys widened in registers. A row whose fp32
/// sum is out of range (detail::sum_squares_in_range, the test CUDA makes: it overflowed or underflowed) gets a
/// positive placeholder score in that pass (one select per row, nothing per element), and a check of the n scores
/// afterwards sums those rows again in fp64, so every finite key scores its correctly rounded norm (-inf above
/// FLT_MAX). The fp64 path sits outside the row loop, which keeps its per-element code. A key with a NaN or Inf
/// element scores -inf (evicted first; its norm is infinite or undefined): only its own slot. No workspace.
template <>
struct Kernel<KnormScorer, Cpu> {
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const&, KnormScorer const&, KVExtents const&, Obs const&) {
    return 0;
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, KnormScorer const&, C const& cache, Obs const&, ScoreSpan<HostSpace> out,
                    Workspace) {
    auto const& keys = cache.keys;
    Index const dim = keys.extents().dim;
    return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index) {
      auto const scale = keys.scale(b, h);
      // detail::reduction_rows rows per pass: independent add chains where one row's chain bounds the loop.
      using Element = std::remove_const_t<std::remove_pointer_t<decltype(keys.row(b, h, 0))>>;
      constexpr int per_pass = detail::reduction_rows<Element>;
      // A placeholder above 0 (every real score is <= 0) for a sum out of range: the fp64 pass below redoes it.
      auto const score_of = [](float sq) { return detail::sum_squares_in_range(sq) ? -std::sqrt(sq) : 1.0f; };
      Index t = 0;
      for (; t + per_pass <= n; t += per_pass) {
        Element const* rows[per_pass];
        for (int k = 0; k < per_pass; ++k)
          rows[k] = keys.row(b, h, t + k);
        float sq[per_pass];
        detail::sum_squares_rows<per_pass>(rows, dim, scale, sq);
        for (int k = 0; k < per_pass; ++k)
          score[t + k] = score_of(sq[k]);
      }
      for (; t < n; ++t)
        score[t] = score_of(detail::sum_squares(keys.row(b, h, t), dim, scale));
      for (Index i = 0; i < n; ++i)
        if (score[i] > 0.0f) [[unlikely]]
          score[i] = knorm_fp64_score(detail::sum_squares_fp64(keys.row(b, h, i), dim, scale));
    });
  }
};

}  // namespace kvc
