// SPDX-License-Identifier: Apache-2.0
// kvc/selectors/ada_kv.hpp: AdaKV, head-adaptive budgets inside a layer (Feng et al., arXiv 2407.11550), over any
// scorer's scores. Code: FFY0/AdaKV adaptive_snapkv/monkeypatch/snapkv_utils.py (AdaptiveSnapKVCluster, the
// authors') and NVIDIA/kvpress kvpress/presses/adakv_press.py.
//
// For sequence b with heads of n_h valid tokens, each head's uniform share comes from the budget (kept =
// budget.keep(b, h, n_h), protected tokens included, as for TopKSelector). Protected tokens (the first n_sink and
// last n_recent) are kept on top of the allocation in both behaviours. Every head's total then goes to TopKSelector
// through a PerHeadBudget table, so each head keeps its protected tokens and its own best unprotected ones.
//
//  - authors (default): the prefix budget of head h is B_h = kept − protected (the authors' C − w), the candidates
//    its unprotected tokens. c_h = head h's winners in the global top-(Σ B_h) of all heads' candidates, and
//    b_h = round_half_even((1 − α)·c_h + floor(α·B_h)), capped at the head's candidates; head h keeps b_h + its
//    protected tokens. Σ b_h may differ from Σ B_h by the rounding (no repair, as the authors). A head whose budget
//    covers all its tokens (kept = n: the authors' "B > N − w", no compression) keeps them all and leaves the pool.
//  - kvpress: every head first keeps its top floor(α·kept) tokens (the safeguard; protected tokens rank first), then
//    the rest of the layer's Σ kept goes to the global best of the remaining tokens: exactly Σ kept per sequence
//    (when the protected tokens fit in it).
// Ranking across heads is by score, then by (head, index) ascending: ties go to the lower head, then the lower
// index, on every backend. Scores must be comparable across heads (softmax outputs are; raw norms less so).
#pragma once

#include <kvc/core/allocator.hpp>
#include <kvc/core/budget.hpp>
#include <kvc/core/params.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/scorers/reference.hpp>
#include <kvc/selectors/allocated_top_k.hpp>
#include <kvc/selectors/top_k.hpp>

#include <cstdint>
#include <tuple>

namespace kvc {

template <Budget B = RatioBudget>
struct AdaKVSelector {
  using budget_type = B;

  B budget{};                                ///< each head's uniform share, protected tokens included
  double alpha_safeguard = 0.2;              ///< α (kvpress's name; the authors' floor_alpha, 0.2 in their scripts)
  Reference reference = Reference::authors;  ///< authors: rounded safeguard mix; kvpress: top-floor(α·kept) pinning
  Index n_sink = 0;                          ///< first tokens always kept (outside the allocation)
  Index n_recent = 0;                        ///< last tokens always kept: the authors' observation window w

  constexpr Status check() const noexcept {
    if (!(alpha_safeguard >= 0.0 && alpha_safeguard <= 1.0))
      return {Errc::invalid_argument, "AdaKVSelector: `alpha_safeguard` must be in [0, 1]"};
    if (n_sink < 0 || n_recent < 0)
      return {Errc::invalid_argument, "AdaKVSelector: `n_sink` and `n_recent` must be >= 0"};
    return budget.check();
  }

  /// The parameters the tools expose (core/params.hpp); the budget and the protected tokens are the caller's.
  static constexpr auto parameters() noexcept {
    return std::tuple{
        named_param("reference", &AdaKVSelector::reference, reference_names,
                    "authors (b_h = round((1-alpha) c_h + floor(alpha B)), the window on top) or kvpress "
                    "(AdaKVPress: each head's top floor(alpha kept) pinned, exactly Hkv x kept per layer)"),
        number_param("alpha_safeguard", &AdaKVSelector::alpha_safeguard, 0, 1,
                     "alpha in [0, 1]: the share of each head's budget it keeps whatever the others")};
  }
};

template <Budget B>
AdaKVSelector(B) -> AdaKVSelector<B>;
template <Budget B>
AdaKVSelector(B, double) -> AdaKVSelector<B>;
template <Budget B>
AdaKVSelector(B, double, Reference) -> AdaKVSelector<B>;
template <Budget B>
AdaKVSelector(B, double, Reference, Index, Index) -> AdaKVSelector<B>;

namespace detail {

/// One head's part in the allocation, shared by every backend.
struct AdaKVHead {
  Index sink_end;  ///< candidates are [sink_end, recent_begin) (authors) or [0, n) (kvpress)
  Index recent_begin;
  Index n;        ///< valid tokens
  Index protect;  ///< protected tokens (kept on top)
  Index share;    ///< authors: the prefix budget min(B_h, candidates); kvpress: kept
  Index safe;     ///< kvpress: tokens pinned by the safeguard, floor(α·kept) capped at n; authors: 0
};

template <Budget B>
KVC_HOST_DEVICE constexpr AdaKVHead ada_kv_head(AdaKVSelector<B> const& sel, Index b, Index h, Index n) noexcept {
  TopKSelector<B> const top{sel.budget, sel.n_sink, sel.n_recent};
  TopKCounts const c = top_k_counts(top, b, h, n);
  Index kept = sel.budget.keep(b, h, n);
  kept = kept < 0 ? 0 : (kept > n ? n : kept);
  Index const protect = c.sink_end + (n - c.recent_begin);
  if (sel.reference == Reference::kvpress) {
    Index const safe = static_cast<Index>(sel.alpha_safeguard * static_cast<double>(kept));
    return {c.sink_end, c.recent_begin, n, protect, kept, safe < n ? safe : n};
  }
  if (kept >= n)  // the budget covers the head: no compression (the authors' "B > N - w"), out of the pool
    return {0, 0, n, n, 0, 0};
  Index const pool = c.recent_begin - c.sink_end;
  Index const prefix = kept > protect ? kept - protect : 0;
  return {c.sink_end, c.recent_begin, n, protect, prefix < pool ? prefix : pool, 0};
}

/// A unique 64-bit rank key: the score's order key (protected tokens above every score), then (head, index)
/// ascending (`flat` = h * tokens + t, below 2^32).
KVC_HOST_DEVICE constexpr std::uint64_t ada_kv_key(float score, bool is_protected, Index flat) noexcept {
  std::uint64_t const hi = is_protected ? 0xffffffffu : score_order_key(score);
  return hi << 32 | (0xffffffffu - static_cast<std::uint32_t>(flat));
}

/// Whether token t of head `a` is protected (kvpress candidates include protected tokens, ranked first).
KVC_HOST_DEVICE constexpr bool ada_kv_protected(AdaKVHead const& a, Index t) noexcept {
  return t < a.sink_end || t >= a.recent_begin;
}

/// The authors' mix b_h = round_half_even((1 − α)·c_h + floor(α·B_h)), capped at the candidates; the table entry
/// adds the protected tokens.
KVC_HOST_DEVICE constexpr Index ada_kv_authors_total(AdaKVHead const& a, double alpha, Index winners) noexcept {
  Index const floor_part = static_cast<Index>(alpha * static_cast<double>(a.share));
  Index bh = round_half_even((1.0 - alpha) * static_cast<double>(winners) + static_cast<double>(floor_part));
  Index const pool = a.recent_begin - a.sink_end;
  bh = bh > pool ? pool : bh;
  return bh + a.protect;
}

}  // namespace detail
}  // namespace kvc
