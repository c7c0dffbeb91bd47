// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/selectors/top_k.hpp: CPU reference for TopKSelector (quickselect, O(n) average per head).
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/selectors/top_k.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace kvc {

namespace detail {

/// The library-wide total order on (score, index): higher score first, then lower index; NaN ranks as -inf.
struct ScoreOrder {
  float const* scores;
  static float rank(float s) noexcept { return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s; }
  bool operator()(Index a, Index b) const noexcept {
    float const sa = rank(scores[a]), sb = rank(scores[b]);
    return sa > sb || (sa == sb && a < b);
  }
};

}  // namespace detail

template <Budget B>
struct Kernel<TopKSelector<B>, Cpu> {
  static std::size_t workspace_bytes(Cpu const& cpu, TopKSelector<B> const&, Index, Index, Index tokens) {
    return bytes_product(cpu.workers(), workspace_round(bytes_product(tokens, sizeof(Index))));
  }

  static Status run(Cpu const& cpu, TopKSelector<B> const& sel, ScoreSpan<HostSpace> scores, KeepPlan<HostSpace> plan,
                    Workspace ws) {
    KVC_RETURN_IF_ERROR(sel.check());
    std::size_t const per_worker = workspace_round(static_cast<std::size_t>(scores.tokens) * sizeof(Index));
    auto* base =
        WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, sel, 0, 0, scores.tokens)));
    if (base == nullptr && scores.tokens > 0)
      return {Errc::out_of_capacity, "kvc::select: workspace smaller than select_workspace_bytes()"};
    KVC_RETURN_IF_ERROR(detail::check_lengths(scores.lengths, scores.batch, scores.heads, scores.tokens,
                                              "kvc::select: every valid length must be in [0, tokens]"));
    for (Index b = 0; b < scores.batch; ++b)  // capacity first, so a failing call leaves the plan untouched
      for (Index h = 0; h < scores.heads; ++h)
        if (detail::top_k_counts(sel, b, h, scores.length(b, h)).keep > plan.capacity)
          return {Errc::out_of_capacity, "kvc::select: a head keeps more tokens than `plan.capacity`"};
    detail::parallel_for(cpu, scores.batch * scores.heads, [&](Index item, Index worker) {
      Index const b = item / scores.heads, h = item % scores.heads;
      Index* candidates = WorkspaceCarver({base + static_cast<std::size_t>(worker) * per_worker, per_worker})
                              .take<Index>(scores.tokens);
      Index const n = scores.length(b, h);
      auto const c = detail::top_k_counts(sel, b, h, n);
      Index* out = plan.indices(b, h);
      plan.kept(b, h) = c.keep;
      if (c.keep == n) {  // within budget: keep everything, no ranking needed
        for (Index t = 0; t < n; ++t)
          out[t] = t;
        return;
      }
      // Rank only the unprotected middle [sink_end, recent_begin); protected tokens are placed around it.
      Index const m = c.keep - c.sink_end - (n - c.recent_begin);
      Index const pool = c.recent_begin - c.sink_end;
      for (Index i = 0; i < pool; ++i)
        candidates[i] = c.sink_end + i;
      detail::ScoreOrder const better{scores.row(b, h)};
      if (m > 0 && m < pool)
        std::nth_element(candidates, candidates + m, candidates + pool, better);
      std::sort(candidates, candidates + m);
      Index j = 0;
      for (Index t = 0; t < c.sink_end; ++t)
        out[j++] = t;
      for (Index i = 0; i < m; ++i)
        out[j++] = candidates[i];
      for (Index t = c.recent_begin; t < n; ++t)
        out[j++] = t;
    });
    return {};
  }
};

}  // namespace kvc
