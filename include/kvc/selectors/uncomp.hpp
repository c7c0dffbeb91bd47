// SPDX-License-Identifier: Apache-2.0
// kvc/selectors/uncomp.hpp: UNComp's entropy-driven head budgets as an allocator (Xiong et al., arXiv 2410.03090,
// §3.3.3 and Eq. 11; docs/policies/uncomp.md).
//
// The budgets of a layer's heads come from the offline calibration (calibration/head_groups.hpp groups the heads by
// their truncated matrix entropy, calibration/head_budgets.hpp turns the groups into integer budgets whose layer
// total is exact). At selection the allocator writes each (sequence, KV head)'s total:
//   table[b, h] = min(n_bh, tokens[h])          (a head whose budget covers it keeps everything)
// and the backend's TopKSelector<PerHeadBudget> keeps that many, the protected window included (the last n_recent
// = w slots are kept even when tokens[h] < w: budgets are clamped to [w, N]). Budgets are the same for every sequence
// of a batch (the calibration is per model, not per input); the table is per sequence because lengths are.
// An engine that sizes a ragged store calls kvc::allocate alone (store/ragged.hpp).
#pragma once

#include <kvc/core/allocator.hpp>
#include <kvc/core/budget.hpp>
#include <kvc/core/status.hpp>
#include <kvc/selectors/allocated_top_k.hpp>

namespace kvc {

/// A layer's per-head token budgets [heads] in memory space `Space` (a Budget: kept = min(n, tokens[h])).
template <class Space = HostSpace>
struct HeadBudgets {
  using memory_space = Space;

  Index const* tokens = nullptr;  ///< [heads], protected tokens included
  Index heads = 0;

  KVC_HOST_DEVICE constexpr Index keep(Index, Index h, Index n) const noexcept {
    Index const k = tokens[h];
    return n < k ? n : (k < 0 ? 0 : k);
  }
  constexpr Status check() const noexcept {
    if (tokens == nullptr || heads <= 0)
      return {Errc::invalid_argument, "HeadBudgets: `tokens` must be non-null and `heads` > 0"};
    return {};
  }
};

/// `HeadBudgets{tokens, heads}` names a host list (device lists spell `HeadBudgets<DeviceSpace>{...}`).
HeadBudgets(Index const*, Index)->HeadBudgets<HostSpace>;

/// UNComp's selector: allocate (table[b, h] = min(n, tokens[h])), then top-k per head with the window protected.
template <class Space = HostSpace>
struct UNCompSelector {
  using budget_type = HeadBudgets<Space>;

  HeadBudgets<Space> budget{};
  Index n_sink = 0;    ///< first tokens always kept (UNComp keeps none)
  Index n_recent = 8;  ///< last tokens always kept: the observation window w

  constexpr Status check() const noexcept {
    if (n_sink < 0 || n_recent < 0)
      return {Errc::invalid_argument, "UNCompSelector: `n_sink` and `n_recent` must be >= 0"};
    return budget.check();
  }
};

template <class Space>
UNCompSelector(HeadBudgets<Space>) -> UNCompSelector<Space>;
template <class Space>
UNCompSelector(HeadBudgets<Space>, Index, Index) -> UNCompSelector<Space>;

namespace detail {

/// One head's total, shared by every backend.
template <class Space>
KVC_HOST_DEVICE constexpr Index uncomp_head_total(UNCompSelector<Space> const& sel, Index h, Index n) noexcept {
  return sel.budget.keep(0, h, n);
}

}  // namespace detail

}  // namespace kvc
