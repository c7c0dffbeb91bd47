// SPDX-License-Identifier: Apache-2.0
// kvc/selectors/top_k.hpp: keep the highest-scoring tokens of each (batch, KV head), plus protected tokens.
#pragma once

#include <kvc/core/budget.hpp>
#include <kvc/core/extents.hpp>
#include <kvc/core/selector.hpp>

#include <cstdint>
#include <type_traits>

namespace kvc {

/// Top-k selection per (batch, KV head) under a budget, as kvpress's ScorerPress does, with optional protected
/// windows (KeyDiff+Recent, SnapKV's observation window, StreamingLLM-style sinks).
///
/// For a head with n valid tokens: the first `n_sink` and the last `n_recent` tokens are protected; the head
/// keeps k = min(n, max(budget.keep(b, h, n), protected)) tokens: every protected token, then the best
/// unprotected ones by (score descending, index ascending). Output indices are ascending. See kvc::Selector.
template <Budget B = RatioBudget>
struct TopKSelector {
  using budget_type = B;

  B budget{};
  Index n_sink = 0;    ///< first tokens always kept
  Index n_recent = 0;  ///< last valid tokens always kept

  constexpr Status check() const noexcept {
    if (n_sink < 0 || n_recent < 0)
      return {Errc::invalid_argument, "TopKSelector: `n_sink` and `n_recent` must be >= 0"};
    return budget.check();
  }
};

template <Budget B>
TopKSelector(B) -> TopKSelector<B>;
template <Budget B>
TopKSelector(B, Index) -> TopKSelector<B>;
template <Budget B>
TopKSelector(B, Index, Index) -> TopKSelector<B>;

namespace detail {

/// How many tokens head (b, h) keeps and where its protected windows lie; shared by every backend.
struct TopKCounts {
  Index sink_end;      ///< tokens [0, sink_end) are protected sinks
  Index recent_begin;  ///< tokens [recent_begin, n) are protected recent tokens
  Index keep;          ///< total kept, protected included
};

template <Budget B>
KVC_HOST_DEVICE constexpr TopKCounts top_k_counts(TopKSelector<B> const& sel, Index b, Index h, Index n) noexcept {
  Index const sink_end = sel.n_sink < n ? sel.n_sink : n;
  Index const recent_begin = n - sel.n_recent > sink_end ? n - sel.n_recent : sink_end;
  Index const protected_count = sink_end + (n - recent_begin);
  Index k = sel.budget.keep(b, h, n);
  k = k < 0 ? 0 : (k > n ? n : k);
  return {sink_end, recent_begin, k > protected_count ? k : protected_count};
}

/// Maps a score to an unsigned key with the same total order as the selection (NaN -> the key of -inf; -0 -> the
/// key of +0): a higher score has a higher key, equal scores equal keys. Both backends' radix selections use it.
KVC_HOST_DEVICE constexpr std::uint32_t score_order_key(float s) noexcept {
  // Branch-free (selects, integer compares): scores are random, so branches on them would mispredict.
  std::uint32_t u = __builtin_bit_cast(std::uint32_t, s);
  u = (u & 0x7fffffffu) > 0x7f800000u ? 0xff800000u : u;  // NaN -> -inf
  u = u == 0x80000000u ? 0u : u;                          // -0 -> +0
  return u ^ (static_cast<std::uint32_t>(static_cast<std::int32_t>(u) >> 31) | 0x80000000u);
}

/// The most tokens any head can keep for scores with `tokens` slots, known on the host without reading the data:
/// exact for RatioBudget and FixedBudget (the same for every head, growing with n), `tokens` for every other budget
/// (per-head tables, schedules that depend on (b, h)). Backends that cannot report a short plan after the fact
/// (CUDA) check plan.capacity against it.
template <Budget B>
constexpr Index top_k_capacity_bound(TopKSelector<B> const& sel, Index tokens) noexcept {
  if constexpr (!std::is_same_v<B, RatioBudget> && !std::is_same_v<B, FixedBudget>) {
    return tokens;
  } else {
    Index const k = sel.budget.keep(0, 0, tokens);
    Index const sink = sel.n_sink < tokens ? sel.n_sink : tokens;  // clamped first: n_sink + n_recent may overflow
    Index const protect = sink + (sel.n_recent < tokens - sink ? sel.n_recent : tokens - sink);
    Index const bound = k > protect ? k : protect;
    return bound < tokens ? bound : tokens;
  }
}

}  // namespace detail
}  // namespace kvc
