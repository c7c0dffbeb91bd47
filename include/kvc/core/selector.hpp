// SPDX-License-Identifier: Apache-2.0
// kvc/core/selector.hpp: the Selector concept, the per-backend SelectKernel extension point and kvc::select().
#pragma once

#include <kvc/backend/tags.hpp>
#include <kvc/core/budget.hpp>
#include <kvc/core/keep_plan.hpp>
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
///  - padding (t >= lengths[b]) is never kept.
template <class S>
concept Selector = std::is_trivially_copyable_v<S> && requires(S const& s) {
  typename S::budget_type;
  { s.budget } -> std::convertible_to<typename S::budget_type>;
} && Budget<typename S::budget_type>;

/// Specialise per (selector, backend) with workspace_bytes(S const&, Index batch, Index heads, Index tokens) and
/// run(B const&, S const&, ScoreSpan<Space>, KeepPlan<Space>, Workspace) -> Status. Primary left undefined.
template <class S, class B>
struct SelectKernel;

template <class S, class B>
concept HasSelectKernel = requires {
  sizeof(SelectKernel<S, B>);
};

/// Bytes of workspace kvc::select needs for scores of the given shape (any alignment).
template <Backend B, Selector S>
std::size_t select_workspace_bytes(B const&, S const& selector, Index batch, Index heads, Index tokens) {
  static_assert(HasSelectKernel<S, B>,
                "kvc::select: this selector has no kernel for this backend; include "
                "<kvc/backend/cpu/selectors/NAME.hpp> or <kvc/backend/cuda/selectors/NAME.cuh>");
  if constexpr (HasSelectKernel<S, B>)
    return SelectKernel<S, B>::workspace_bytes(selector, batch, heads, tokens) + workspace_slack;
  else
    return 0;
}

/// Selects the tokens to keep. Errors: plan shape differs from the scores' (invalid_argument), plan capacity
/// smaller than a head's kept count (out_of_capacity; checked on the CPU, clamped on CUDA), workspace too small.
template <Backend B, Selector S>
Status select(B const& backend, S const& selector, ScoreSpan<typename B::memory_space> scores,
              KeepPlan<typename B::memory_space> plan, Workspace ws = {}) {
  static_assert(HasSelectKernel<S, B>,
                "kvc::select: this selector has no kernel for this backend; include "
                "<kvc/backend/cpu/selectors/NAME.hpp> or <kvc/backend/cuda/selectors/NAME.cuh>");
  if constexpr (HasSelectKernel<S, B>) {
    if (plan.batch != scores.batch || plan.heads != scores.heads)
      return {Errc::invalid_argument, "kvc::select: `plan` must have the scores' batch and heads"};
    if ((plan.index == nullptr || plan.count == nullptr) && plan.batch * plan.heads > 0)
      return {Errc::invalid_argument, "kvc::select: `plan.index` and `plan.count` must not be null"};
    if (plan.capacity < 0)
      return {Errc::invalid_argument, "kvc::select: `plan.capacity` must be >= 0"};
    return SelectKernel<S, B>::run(backend, selector, scores, plan, ws);
  } else {
    return {Errc::invalid_argument, "unreachable"};
  }
}

}  // namespace kvc
