// SPDX-License-Identifier: Apache-2.0
// kvc/core/allocator.hpp: the allocate step: scores of a whole layer -> per-(sequence, KV head) token budgets.
//
// An allocator spreads a layer's budget over its heads (AdaKV; UNComp's entropy budgets come next). Its output is a
// table [batch, heads] of tokens each head keeps, in the backend's memory space (a device table for CUDA), which
// feeds the existing TopKSelector unchanged through PerHeadBudget. Its kernel is Kernel<Allocation<Sel>, B>;
// kvc::allocate is the entry point, and an adaptive selector (AdaKVSelector) runs allocate then top-k in one
// kvc::select (selectors/allocated_top_k.hpp), so every driver (compress, blockwise, decode_step) takes it as it
// takes TopKSelector.
#pragma once

#include <kvc/core/budget.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/core/selector.hpp>
#include <kvc/core/workspace.hpp>

#include <cstddef>
#include <cstdint>

namespace kvc {

/// The allocation step of an adaptive selector `Sel` (the Op of Kernel<Allocation<Sel>, B>).
template <class Sel>
struct Allocation {
  Sel selector;
};

/// Bytes of workspace kvc::allocate needs (any alignment).
template <Backend B, Selector Sel>
std::size_t allocate_workspace_bytes(B const& backend, Sel const& sel, Index batch, Index heads, Index tokens) {
  static_assert(HasKernel<Allocation<Sel>, B>,
                "kvc::allocate: no allocation kernel for this backend; include "
                "<kvc/backend/cpu/selectors/NAME.hpp> or <kvc/backend/cuda/selectors/NAME.cuh>");
  if constexpr (HasKernel<Allocation<Sel>, B>)
    return bytes_sum(Kernel<Allocation<Sel>, B>::workspace_bytes(backend, sel, batch, heads, tokens), workspace_slack);
  else
    return 0;
}

/// Writes the tokens each (sequence, KV head) keeps, protected tokens included, into `table` ([batch, heads] of
/// the scores, in the backend's memory space). Errors: bad selector parameters, null table, lengths outside
/// [0, tokens] (CPU), workspace too small.
template <Backend B, Selector Sel>
Status allocate(B const& backend, Sel const& sel, ScoreSpan<typename B::memory_space> scores, Index* table,
                Workspace ws) {
  static_assert(HasKernel<Allocation<Sel>, B>,
                "kvc::allocate: no allocation kernel for this backend; include "
                "<kvc/backend/cpu/selectors/NAME.hpp> or <kvc/backend/cuda/selectors/NAME.cuh>");
  static_assert(BudgetReadableBy<typename Sel::budget_type, B>,
                "kvc::allocate: the budget's table lives in a memory space this backend cannot read");
  if constexpr (HasKernel<Allocation<Sel>, B> && BudgetReadableBy<typename Sel::budget_type, B>) {
    KVC_RETURN_IF_ERROR(sel.check());
    if (!detail::scores_fit(scores))  // data may be null: an allocator that does not read scores (UNComp's)
      return {Errc::invalid_argument,
              "kvc::allocate: `scores` must have extents >= 0 whose element count fits in 64 bits"};
    if (table == nullptr && scores.batch * scores.heads > 0)
      return {Errc::invalid_argument, "kvc::allocate: `table` ([batch, heads]) must not be null"};
    if (detail::overlap(detail::bytes_of(table, scores.batch * scores.heads),
                        detail::bytes_of(scores.data, scores.size())))
      return {Errc::invalid_argument, "kvc::allocate: `table` overlaps `scores`"};
    KVC_RETURN_IF_ERROR(check_length_table(
        scores.lengths, scores.heads, "kvc::allocate: a per-head length table must be [batch, heads of the scores]"));
    if (ws.bytes < Kernel<Allocation<Sel>, B>::workspace_bytes(backend, sel, scores.batch, scores.heads, scores.tokens))
      return {Errc::out_of_capacity, "kvc::allocate: workspace smaller than allocate_workspace_bytes()"};
    return Kernel<Allocation<Sel>, B>::run(backend, sel, scores, table, ws);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

namespace detail {

/// Round half to even of a non-negative x (Python's round, torch.round; std::round rounds half away from zero),
/// constexpr and usable on the device.
KVC_HOST_DEVICE constexpr Index round_half_even(double x) noexcept {
  Index const f = static_cast<Index>(x);
  double const r = x - static_cast<double>(f);
  return r > 0.5 ? f + 1 : (r < 0.5 ? f : f + (f & 1));
}

}  // namespace detail
}  // namespace kvc
