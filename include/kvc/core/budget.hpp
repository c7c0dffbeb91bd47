// SPDX-License-Identifier: Apache-2.0
// kvc/core/budget.hpp: how many tokens one (batch, KV head) keeps.
#pragma once

#include <kvc/core/backend.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>

#include <concepts>
#include <type_traits>

namespace kvc {

/// A budget maps (batch row, KV head, valid tokens n) to the number of tokens to keep, before protected tokens
/// are added and before capping at n. Budgets are trivially copyable so they travel to device kernels.
/// `check()` validates the parameters once before selection (selectors call it). A budget that reads memory names
/// its `memory_space`; budgets without one (RatioBudget, FixedBudget) are plain values, usable on every backend.
template <class B>
concept Budget = std::is_trivially_copyable_v<B> && requires(B const& b, Index i) {
  { b.keep(i, i, i) } -> std::convertible_to<Index>;
  { b.check() } -> std::same_as<Status>;
};

/// kvpress semantics: `ratio` is the fraction **removed**, kept = floor(n * (1 - ratio)), computed in double as
/// Python does. Valid ratios are in [0, 1]; validate_budget() rejects others.
struct RatioBudget {
  double ratio = 0.0;

  KVC_HOST_DEVICE constexpr Index keep(Index, Index, Index n) const noexcept {
    return static_cast<Index>(static_cast<double>(n) * (1.0 - ratio));
  }
  constexpr Status check() const noexcept {
    if (!(ratio >= 0.0 && ratio <= 1.0))  // also rejects NaN
      return {Errc::invalid_argument, "RatioBudget: `ratio` (fraction removed) must be in [0, 1]"};
    return {};
  }
};

/// A fixed number of tokens per head (the papers' N): kept = min(n, tokens).
struct FixedBudget {
  Index tokens = 0;

  KVC_HOST_DEVICE constexpr Index keep(Index, Index, Index n) const noexcept { return n < tokens ? n : tokens; }
  constexpr Status check() const noexcept {
    if (tokens < 0)
      return {Errc::invalid_argument, "FixedBudget: `tokens` must be >= 0"};
    return {};
  }
};

/// A per-(batch, KV head) table of token counts, filled by an allocator (AdaKV, UNComp, ...).
/// `table` is [batch, heads] in memory space `Space`, which must be the backend's (a host table handed to the CUDA
/// backend is a compile-time error).
template <class Space = HostSpace>
struct PerHeadBudget {
  using memory_space = Space;

  Index const* table = nullptr;
  Index heads = 0;

  KVC_HOST_DEVICE constexpr Index keep(Index b, Index h, Index n) const noexcept {
    Index const k = table[b * heads + h];
    return n < k ? n : k;
  }
  constexpr Status check() const noexcept {
    if (table == nullptr || heads <= 0)
      return {Errc::invalid_argument, "PerHeadBudget: `table` must be non-null and `heads` > 0"};
    return {};
  }
};

/// `PerHeadBudget{table, heads}` names a host table (device tables spell `PerHeadBudget<DeviceSpace>{...}`).
PerHeadBudget(Index const*, Index)->PerHeadBudget<HostSpace>;

/// Whether backend B can read budget `Bud` (no memory, or memory in B's space).
template <class Bud, class B>
concept BudgetReadableBy = !requires {
  typename Bud::memory_space;
}
|| ReadableBy<Bud, B>;

}  // namespace kvc
