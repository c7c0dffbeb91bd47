// SPDX-License-Identifier: Apache-2.0
// kvc/core/selector.hpp: the Selector concept, the per-backend SelectKernel extension point and kvc::select().
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/budget.hpp>
#include <kvc/core/checks.hpp>
#include <kvc/core/keep_plan.hpp>
#include <kvc/core/kernel.hpp>
#include <kvc/core/scores.hpp>
#include <kvc/core/status.hpp>
#include <kvc/core/workspace.hpp>

#include <cstddef>
#include <type_traits>

namespace kvc {

/// A selector turns scores into a KeepPlan. Contract every selector honours:
///  - kept indices are strictly ascending;
///  - higher score wins; on equal scores the lower index wins; NaN ranks as -inf (deterministic on every backend);
///  - protected tokens (sinks, recent window) are always kept, even beyond the budget;
///  - a head whose valid length n is within its budget keeps everything; budget 0 keeps only protected tokens;
///  - padding (t >= the head's valid length) is never kept.
template <class S>
concept Selector = std::is_trivially_copyable_v<S> && requires(S const& s) {
  typename S::budget_type;
  { s.budget } -> std::convertible_to<typename S::budget_type>;
} && Budget<typename S::budget_type>;

/// Bytes of workspace kvc::select needs for scores of the given shape (any alignment).
template <Backend B, Selector S>
std::size_t select_workspace_bytes(B const& backend, S const& selector, Index batch, Index heads, Index tokens) {
  static_assert(HasKernel<S, B>,
                "kvc::select: this selector has no kernel for this backend; include "
                "<kvc/backend/cpu/selectors/NAME.hpp> or <kvc/backend/cuda/selectors/NAME.cuh>");
  if constexpr (HasKernel<S, B>)
    return bytes_sum(Kernel<S, B>::workspace_bytes(backend, selector, batch, heads, tokens), workspace_slack);
  else
    return 0;
}

/// Selects the tokens to keep. Errors: plan shape differs from the scores' (invalid_argument), plan capacity
/// smaller than a head's kept count (out_of_capacity, on every backend), workspace too small.
/// A budget that reads memory (PerHeadBudget<Space>) must live in the backend's memory space (compile time).
template <Backend B, Selector S>
Status select(B const& backend, S const& selector, ScoreSpan<typename B::memory_space> scores,
              KeepPlan<typename B::memory_space> plan, Workspace ws) {
  static_assert(HasKernel<S, B>,
                "kvc::select: this selector has no kernel for this backend; include "
                "<kvc/backend/cpu/selectors/NAME.hpp> or <kvc/backend/cuda/selectors/NAME.cuh>");
  static_assert(BudgetReadableBy<typename S::budget_type, B>,
                "kvc::select: the budget's table lives in a memory space this backend cannot read (use "
                "PerHeadBudget<DeviceSpace> with kvc::Cuda)");
  if constexpr (HasKernel<S, B> && BudgetReadableBy<typename S::budget_type, B>) {
    if (!detail::scores_fit(scores) || (scores.data == nullptr && scores.size() > 0))
      return {Errc::invalid_argument,
              "kvc::select: `scores` must have extents >= 0 whose element count fits in 64 bits, and data"};
    if (plan.batch != scores.batch || plan.heads != scores.heads)
      return {Errc::invalid_argument, "kvc::select: `plan` must have the scores' batch and heads"};
    if ((plan.index == nullptr || plan.count == nullptr) && plan.batch * plan.heads > 0)
      return {Errc::invalid_argument, "kvc::select: `plan.index` and `plan.count` must not be null"};
    Index cells = 0;
    if (plan.capacity < 0 || !checked_product(cells, plan.batch, plan.heads, plan.capacity))
      return {Errc::invalid_argument, "kvc::select: `plan.capacity` must be >= 0 and [batch, heads, capacity] fit"};
    // The plan is written while the scores are read (and a selector's scratch is written beside both).
    detail::PlanBytes const written = detail::bytes_of(plan);
    detail::ByteRange const read = detail::bytes_of(scores.data, scores.size()), scratch = detail::bytes_of(ws);
    if (detail::overlap(written.index, read) || detail::overlap(written.count, read) ||
        detail::overlap(written.index, written.count))
      return {Errc::invalid_argument, "kvc::select: `plan.index`, `plan.count` and `scores` must not overlap"};
    if (detail::overlap(scratch, read) || detail::overlap(scratch, written.index) ||
        detail::overlap(scratch, written.count))
      return {Errc::invalid_argument, "kvc::select: the workspace overlaps `scores` or `plan`"};
    KVC_RETURN_IF_ERROR(check_length_table(
        scores.lengths, scores.heads, "kvc::select: a per-head length table must be [batch, heads of the scores]"));
    if constexpr (requires { selector.budget.heads; })
      if (selector.budget.heads != scores.heads)
        return {Errc::invalid_argument, "kvc::select: the per-head budget table must be [batch, heads of the scores]"};
    if (ws.bytes < Kernel<S, B>::workspace_bytes(backend, selector, scores.batch, scores.heads, scores.tokens))
      return {Errc::out_of_capacity, "kvc::select: workspace smaller than select_workspace_bytes()"};
    return Kernel<S, B>::run(backend, selector, scores, plan, ws);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

}  // namespace kvc
