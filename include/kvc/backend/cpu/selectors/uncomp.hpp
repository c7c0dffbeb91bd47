// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/selectors/uncomp.hpp: CPU allocation and selection of UNCompSelector.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/top_k.hpp>
#include <kvc/selectors/uncomp.hpp>

namespace kvc {

/// table[b, h] = min(n_bh, tokens[h]); the scores are not read (the budgets were set by the calibration).
template <>
struct Kernel<Allocation<UNCompSelector<HostSpace>>, Cpu> {
  using Sel = UNCompSelector<HostSpace>;

  static std::size_t workspace_bytes(Cpu const&, Sel const&, Index, Index, Index) { return 0; }

  static Status run(Cpu const&, Sel const& sel, ScoreSpan<HostSpace> scores, Index* table, Workspace) {
    if (sel.budget.heads != scores.heads)
      return {Errc::invalid_argument, "kvc::allocate(uncomp): the budget list must have one entry per KV head"};
    KVC_RETURN_IF_ERROR(detail::check_lengths(scores.lengths, scores.batch, scores.heads, scores.tokens,
                                              "kvc::allocate: every valid length must be in [0, tokens]"));
    for (Index b = 0; b < scores.batch; ++b)
      for (Index h = 0; h < scores.heads; ++h)
        table[b * scores.heads + h] = detail::uncomp_head_total(sel, h, scores.length(b, h));
    return {};
  }
};

/// UNComp selection on the CPU: the allocation above, then TopKSelector over the table.
template <>
struct Kernel<UNCompSelector<HostSpace>, Cpu> : detail::AllocatedTopK<UNCompSelector<HostSpace>, Cpu> {};

}  // namespace kvc
