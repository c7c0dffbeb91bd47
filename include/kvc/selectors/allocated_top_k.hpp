// SPDX-License-Identifier: Apache-2.0
// kvc/selectors/allocated_top_k.hpp: the selection of an adaptive selector (AdaKV, UNComp) on any backend: its
// allocation (core/allocator.hpp), then TopKSelector over the per-head table it wrote.
#pragma once

#include <kvc/core/allocator.hpp>
#include <kvc/core/budget.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/workspace.hpp>
#include <kvc/selectors/top_k.hpp>

#include <cstddef>

namespace kvc::detail {

/// Selection of an adaptive selector on any backend: allocate into a [batch, heads] table carved from the
/// workspace, then the backend's TopKSelector over PerHeadBudget with the selector's protected windows.
template <class Sel, Backend B>
struct AllocatedTopK {
  using Space = typename B::memory_space;
  using TopK = TopKSelector<PerHeadBudget<Space>>;

  static TopK top_k(Sel const& sel, Index const* table, Index heads) noexcept {
    return {{table, heads}, sel.n_sink, sel.n_recent};
  }
  static std::size_t workspace_bytes(B const& backend, Sel const& sel, Index batch, Index heads, Index tokens) {
    std::size_t const alloc = Kernel<Allocation<Sel>, B>::workspace_bytes(backend, sel, batch, heads, tokens);
    std::size_t const select =
        Kernel<TopK, B>::workspace_bytes(backend, top_k(sel, nullptr, heads), batch, heads, tokens);
    return bytes_sum(workspace_round(bytes_product(batch, heads, sizeof(Index))),
                     workspace_round(alloc > select ? alloc : select), workspace_slack);
  }
  static Status run(B const& backend, Sel const& sel, ScoreSpan<Space> scores, KeepPlan<Space> plan, Workspace ws) {
    WorkspaceCarver carve(ws);
    Index* table = carve.take<Index>(scores.batch * scores.heads);
    Workspace const rest = carve.rest();
    if (table == nullptr && scores.batch * scores.heads > 0)
      return {Errc::out_of_capacity, "kvc::select: workspace smaller than select_workspace_bytes()"};
    KVC_RETURN_IF_ERROR(allocate(backend, sel, scores, table, rest));
    return Kernel<TopK, B>::run(backend, top_k(sel, table, scores.heads), scores, plan, rest);
  }
};

}  // namespace kvc::detail
