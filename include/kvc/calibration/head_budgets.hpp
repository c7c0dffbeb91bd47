// SPDX-License-Identifier: Apache-2.0
// kvc/calibration/head_budgets.hpp: UNComp's per-head KV budgets inside a layer from the head groups (Xiong et al.,
// arXiv 2410.03090, Eq. 11, Table 9; decisions A6, A7, A16 in docs/policies/uncomp.md). Host only, no allocation.
//
// Group g (0-based here; the paper's g + 1) of a layer keeps N_g tokens per head, group 0 = highest entropy = most:
//  - preserving (default, kvc's closed form, A6): N_g = B̄ + (c − (g + 1))·Δ with c = Σ_g n_g (g + 1) / H, so that
//    Σ_h N_{g(h)} = H·B̄ for any group sizes n_g (c = (M+1)/2 for equal sizes: B̄ = 384, M = 8, Δ = 74 gives
//    [643, 569, 495, 421, 347, 273, 199, 125]);
//  - paper (Eq. 11, g = 1..M−1): N_g = N_max − g·Δ (640 and 74: [640, 566, …, 122], mean 381);
//  - list: the caller's (or a preset's) [M] budgets, group 0 first.
// The same list serves every layer (UNComp has no layer schedule). Integer budgets come from largest-remainder
// rounding (head_budgets), then a floor at the observation window w; the allocator later takes min(budget, n).
#pragma once

#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>

#include <cmath>
#include <cstdint>
#include <string_view>

namespace kvc {

/// How the per-group budgets are made (docs/policies/uncomp.md, decision A6).
enum class BudgetSchedule : std::uint8_t {
  preserving,  ///< N_g = B̄ + (c − g)·Δ, g = 1..M: the layer total is H·B̄ exactly (default)
  paper,       ///< N_1 = N_max, N_{g+1} = N_g − Δ (Eq. 11; not budget-preserving)
  list,        ///< explicit [groups] budgets (e.g. a head_budget_preset)
};

/// Parameters of the per-head budgets. Units: tokens per head.
struct HeadBudgetSpec {
  double average = 384;  ///< B̄, mean tokens per head (preserving)
  Index groups = 8;      ///< M, head groups per layer
  double step = 74;      ///< Δ, tokens between neighbouring groups (preserving, paper)
  Index largest = 640;   ///< N_max, group 0's budget (paper)
  BudgetSchedule schedule = BudgetSchedule::preserving;
  Index const* list = nullptr;  ///< [groups] budgets for BudgetSchedule::list, group 0 = highest entropy; >= 0

  constexpr Status check() const noexcept {
    if (groups < 1)
      return {Errc::invalid_argument, "HeadBudgetSpec: `groups` must be >= 1"};
    if (!(step >= 0.0) || !(step < 1e15))
      return {Errc::invalid_argument, "HeadBudgetSpec: `step` must be finite and >= 0"};
    switch (schedule) {
      case BudgetSchedule::preserving:
        if (!(average >= 0.0) || !(average < 1e15))
          return {Errc::invalid_argument, "HeadBudgetSpec: `average` must be finite and >= 0"};
        // The smallest budget B̄ − (M − c)Δ is >= B̄ − (M − 1)Δ: checked per layer (it depends on the sizes).
        return {};
      case BudgetSchedule::paper:
        if (largest < 0)
          return {Errc::invalid_argument, "HeadBudgetSpec: `largest` must be >= 0"};
        if (static_cast<double>(largest) - static_cast<double>(groups - 1) * step < 0.0)
          return {Errc::invalid_argument, "HeadBudgetSpec: `largest` − (groups − 1)·`step` must be >= 0"};
        return {};
      case BudgetSchedule::list:
        if (list == nullptr)
          return {Errc::invalid_argument, "HeadBudgetSpec: `list` must be non-null ([groups]) for schedule list"};
        for (Index g = 0; g < groups; ++g)
          if (list[g] < 0)
            return {Errc::invalid_argument, "HeadBudgetSpec: every entry of `list` must be >= 0"};
        return {};
    }
    return {Errc::invalid_argument, "HeadBudgetSpec: unknown `schedule`"};
  }
};

namespace detail {

/// The real-valued budget of group g (0-based) given the preserving centre c (1-based groups).
constexpr double group_budget(HeadBudgetSpec const& s, double centre, Index g) noexcept {
  switch (s.schedule) {
    case BudgetSchedule::preserving: return s.average + (centre - static_cast<double>(g + 1)) * s.step;
    case BudgetSchedule::paper: return static_cast<double>(s.largest) - static_cast<double>(g) * s.step;
    case BudgetSchedule::list: return static_cast<double>(s.list[g]);
  }
  return 0.0;
}

}  // namespace detail

/// Per-group budgets per_group [groups] (real-valued, before rounding), group 0 = highest entropy.
/// group_sizes [groups] (>= 0, sum >= 1) is read by the preserving schedule only: c = Σ_g n_g (g + 1) / H; null there
/// means equal sizes (c = (M+1)/2). A budget may come out below 0 when Δ is large for B̄; head_budgets clamps it.
inline Status group_budgets(HeadBudgetSpec const& spec, Index const* group_sizes /*[groups] or null*/,
                            double* per_group /*[groups]*/) noexcept {
  KVC_RETURN_IF_ERROR(spec.check());
  if (per_group == nullptr)
    return {Errc::invalid_argument, "group_budgets: `per_group` must be non-null ([groups])"};
  double centre = static_cast<double>(spec.groups + 1) / 2.0;
  if (spec.schedule == BudgetSchedule::preserving && group_sizes != nullptr) {
    Index heads = 0, weighted = 0;
    for (Index g = 0; g < spec.groups; ++g) {
      if (group_sizes[g] < 0)
        return {Errc::invalid_argument, "group_budgets: every entry of `group_sizes` must be >= 0"};
      heads += group_sizes[g];
      weighted += group_sizes[g] * (g + 1);
    }
    if (heads < 1)
      return {Errc::invalid_argument, "group_budgets: `group_sizes` must sum to >= 1"};
    centre = static_cast<double>(weighted) / static_cast<double>(heads);
  }
  for (Index g = 0; g < spec.groups; ++g)
    per_group[g] = detail::group_budget(spec, centre, g);
  return {};
}

/// Integer per-head budgets budget [heads] of one layer from group_of_head [heads] (values in [0, groups), 0 = highest
/// entropy, as group_heads gives). Each head's real budget is its group's (group_budgets with the layer's sizes);
/// they are rounded by largest remainder so that the layer total is exactly round(Σ real budgets) (= round(H·B̄) for
/// preserving): every head gets ⌊N_g⌋, and the deficit goes +1 to the heads with the largest fractional part, ties to
/// the lower group (higher entropy), then the lower head index. So heads of one group differ by at most 1 (and are
/// equal when the deficit does not stop inside the group, e.g. whenever the N_g are integers), and budgets are
/// non-increasing in the group (preserving and paper) whenever Δ >= 1. Within a group the +1 goes by head index: this
/// function does not see the entropies. The total is std::round of H·B̄ (halves away from zero). Then clamped to
/// [min_tokens, ∞) (min_tokens = w, >= 0; a negative real budget, from a Δ too large for B̄, is clamped too): the
/// total is exact unless the clamp raised a head. (Clamping to the
/// sequence's length n happens at selection: the allocator takes min(budget, n).) O(heads²), no allocation.
inline Status head_budgets(HeadBudgetSpec const& spec, Index const* group_of_head /*[heads]*/, Index heads,
                           Index min_tokens, Index* budget /*[heads]*/) noexcept {
  KVC_RETURN_IF_ERROR(spec.check());
  if (heads < 1)
    return {Errc::invalid_argument, "head_budgets: `heads` must be >= 1"};
  if (min_tokens < 0)
    return {Errc::invalid_argument, "head_budgets: `min_tokens` must be >= 0"};
  if (group_of_head == nullptr || budget == nullptr)
    return {Errc::invalid_argument, "head_budgets: `group_of_head` and `budget` must be non-null ([heads])"};
  Index weighted = 0;
  for (Index h = 0; h < heads; ++h) {
    if (group_of_head[h] < 0 || group_of_head[h] >= spec.groups)
      return {Errc::invalid_argument, "head_budgets: every entry of `group_of_head` must be in [0, groups)"};
    weighted += group_of_head[h] + 1;
  }
  double const centre = static_cast<double>(weighted) / static_cast<double>(heads);
  auto real = [&](Index h) { return detail::group_budget(spec, centre, group_of_head[h]); };
  double sum = 0.0;
  for (Index h = 0; h < heads; ++h)
    sum += real(h);
  double const total = spec.schedule == BudgetSchedule::preserving
                           ? std::round(static_cast<double>(heads) * spec.average)
                           : std::round(sum);
  double floors = 0.0;
  for (Index h = 0; h < heads; ++h)
    floors += std::floor(real(h));
  double const missing = total - floors;  // in [0, heads] up to round-off
  Index const deficit = missing < 0.0 ? 0 : (missing > static_cast<double>(heads) ? heads : std::llround(missing));
  auto before = [&](Index a, Index b) {  // a takes a unit before b
    double const ra = real(a) - std::floor(real(a)), rb = real(b) - std::floor(real(b));
    if (ra != rb)
      return ra > rb;
    if (group_of_head[a] != group_of_head[b])
      return group_of_head[a] < group_of_head[b];
    return a < b;
  };
  for (Index h = 0; h < heads; ++h) {
    Index rank = 0;
    for (Index j = 0; j < heads; ++j)
      rank += j != h && before(j, h) ? 1 : 0;
    Index const b = static_cast<Index>(std::floor(real(h))) + (rank < deficit ? 1 : 0);
    budget[h] = b < min_tokens ? min_tokens : b;
  }
  return {};
}

namespace detail {
inline constexpr Index preset_authors_384[] = {640, 567, 494, 421, 348, 275, 202, 129};
inline constexpr Index preset_paper_384[] = {640, 566, 492, 418, 344, 270, 196, 122};
inline constexpr Index preset_wide_2[] = {736, 32};
inline constexpr Index preset_narrow_2[] = {512, 256};
inline constexpr Index preset_wide_3[] = {736, 384, 32};
inline constexpr Index preset_narrow_3[] = {512, 384, 256};
inline constexpr Index preset_wide_4[] = {736, 502, 266, 32};
inline constexpr Index preset_narrow_4[] = {512, 427, 342, 256};
inline constexpr Index preset_wide_5[] = {736, 560, 384, 208, 32};
inline constexpr Index preset_narrow_5[] = {512, 448, 384, 320, 256};
inline constexpr Index preset_wide_8[] = {736, 636, 536, 436, 332, 232, 132, 32};
}  // namespace detail

/// The authors' hard-coded lists (Table 9 and the code's "new1" list), group 0 = highest entropy, for
/// BudgetSchedule::list: "authors_384" [640, 567, …, 129] (mean 384.5, what the paper's KV-384 runs used),
/// "paper_384" [640, 566, …, 122] (= the paper schedule, mean 381), "wide_2" [736, 32], "narrow_2" [512, 256],
/// "wide_3", "narrow_3", "wide_4", "narrow_4", "wide_5", "narrow_5", "wide_8" (Table 9: means 384, narrow_4 384.25).
/// Table 9's narrow 8-group list is elided in the paper ("256/296/332/…/512"), so there is no "narrow_8". Returns a
/// pointer to static storage, or nullptr for an unknown name; `groups` receives M (0 for an unknown name).
inline Index const* head_budget_preset(std::string_view name, Index& groups) noexcept {
  struct Entry {
    std::string_view name;
    Index const* list;
    Index groups;
  };
  static constexpr Entry entries[] = {
      {"authors_384", detail::preset_authors_384, 8}, {"paper_384", detail::preset_paper_384, 8},
      {"wide_2", detail::preset_wide_2, 2},           {"narrow_2", detail::preset_narrow_2, 2},
      {"wide_3", detail::preset_wide_3, 3},           {"narrow_3", detail::preset_narrow_3, 3},
      {"wide_4", detail::preset_wide_4, 4},           {"narrow_4", detail::preset_narrow_4, 4},
      {"wide_5", detail::preset_wide_5, 5},           {"narrow_5", detail::preset_narrow_5, 5},
      {"wide_8", detail::preset_wide_8, 8},
  };
  for (Entry const& e : entries) {
    if (e.name == name) {
      groups = e.groups;
      return e.list;
    }
  }
  groups = 0;
  return nullptr;
}

}  // namespace kvc
