// SPDX-License-Identifier: Apache-2.0
// kvc/calibration/uncomp_policy.hpp: UNComp (Xiong et al., arXiv 2410.03090; docs/policies/uncomp.md) as the tools
// and presses configure it: its window scorer, the schedule of its entropy groups' budgets and how it meets GQA,
// each parameter declared once (core/params.hpp). What comes from a calibration (the groups, their rule) or from
// the caller's budget (HeadBudgetSpec::average, a `list` of budgets, an automatic step) is the caller's.
#pragma once

#include <kvc/calibration/head_budgets.hpp>
#include <kvc/core/params.hpp>
#include <kvc/core/status.hpp>
#include <kvc/scorers/snap_kv.hpp>
#include <kvc/scorers/uncomp.hpp>

#include <cstdint>
#include <string_view>
#include <tuple>

namespace kvc {

/// How UNComp meets GQA: per-KV-head budgets and scores (scores summed over each group's query heads), or the
/// authors' caches expanded to one KV head per query head (K/V repeated: Hq / Hkv times the memory).
enum class UNCompGqa : std::uint8_t { kv_heads, expand };

/// UNComp as one policy: `scorer`'s window, kernel and pooling (its state is per layer), the budgets' schedule and
/// group 0's budget (`budgets`: its groups, average, step and list are set per layer by the caller), and `gqa`.
struct UNCompPolicy {
  static constexpr std::string_view name = "uncomp";

  UNCompScorer<> scorer{};
  HeadBudgetSpec budgets{};
  UNCompGqa gqa = UNCompGqa::kv_heads;

  /// The parameters the tools expose (core/params.hpp).
  static constexpr auto parameters() noexcept {
    using P = UNCompPolicy;
    using S = UNCompScorer<>;
    return std::tuple{
        nested(&P::scorer, number_param("window_size", &S::window_size, 1, max_param_index,
                                        "w: the last w queries vote; the window is always kept (UNComp's l = 8)")),
        nested(&P::scorer, odd_param("kernel_size", &S::kernel_size, 1, max_param_index,
                                     "pooling kernel along the tokens, odd (the authors' runs: max pooling, 7)")),
        nested(&P::scorer, named_param("pooling", &S::pooling, {{"max", Pooling::max}, {"avg", Pooling::avg}},
                                       "max or avg (avg always divides by kernel_size, as PyTorch)")),
        nested(&P::budgets,
               named_param("schedule", &HeadBudgetSpec::schedule,
                           {{"preserving", BudgetSchedule::preserving},
                            {"paper", BudgetSchedule::paper},
                            {"list", BudgetSchedule::list}},
                           "preserving (N_g = B + (c - g) step: each layer's total is heads x B, B from "
                           "--budget/--ratio), paper (N_1 = largest, N_g+1 = N_g - step) or list (the budgets of "
                           "`list` or `preset`)")),
        nested(&P::budgets, number_param("largest", &HeadBudgetSpec::largest, 0, max_param_index,
                                         "group 0's budget under schedule=paper")),
        named_param("gqa", &P::gqa, {{"kv_heads", UNCompGqa::kv_heads}, {"expand", UNCompGqa::expand}},
                    "kv_heads (per-KV-head budgets from the KV heads' groups, scores summed over each group's query "
                    "heads) or expand (the authors' per-query-head caches: K/V repeated to Hq heads, Hq / Hkv times "
                    "the memory)")};
  }

  /// The scorer's own check (the budgets are checked per layer, once the caller has set them).
  constexpr Status check() const noexcept { return scorer.check(); }
};

}  // namespace kvc
