// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/moment_kv.hpp: MomentKV's prefill compression (docs/policies/moment_kv.md, decision A1): the paper's
// Algorithm 1 is decode-only, and the exact greedy over the N − L prefill evictions costs O((N − L) N d²), so the
// evictions run in `prefill_rounds` rounds:
//   1. α = the base score (SnapKV's window attention, pooled), once; frozen for every round;
//   2. each head's budget L_h = what `selector` keeps on α (TopKSelector: uniform; AdaKVSelector: Ada-KV's
//      head-wise budgets; PyramidKVBudget: per layer), protected tokens included;
//   3. each round: MI scores α_j ‖r_j‖ under the current moments; a head with n > L_h slots keeps
//      n − ceil((n − L_h) / rounds left) (MomentRoundBudget), with the selector's sink and recent window protected;
//      kvc::on_evict folds the evicted rows into the moments (one block update); kvc::compact moves the cache and α.
// Round 1 of 1 is the one-shot top-k of α_j ‖v_j‖; N − L rounds evict one token per round (the exact greedy of
// Algorithm 1 with a fixed base). Written over the entry points only, so it runs on every backend with MomentKV's
// kernels. Decoding then runs kvc::decode_step with scorer.decode() (one eviction per step per head over budget)
// and kvc::attend_corrected.
#pragma once

#include <kvc/core/checks.hpp>
#include <kvc/pipeline/compact.hpp>
#include <kvc/pipeline/press.hpp>
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/selectors/top_k.hpp>

#include <cstddef>

namespace kvc {

namespace detail {
template <class Space, class T>
constexpr MomentKVScorer<Space, T> with_fixed_base(MomentKVScorer<Space, T> s, TokenArray<float, Space> base) noexcept {
  s.fixed_base = {base.data, base.batch, base.heads, base.tokens};
  return s;
}
template <class Space>
constexpr TopKSelector<MomentRoundBudget<Space>> round_selector(Index const* targets, Index heads, Index rounds_left,
                                                                Index n_sink, Index n_recent) noexcept {
  return {{{targets, heads}, rounds_left}, n_sink, n_recent};
}
}  // namespace detail

/// Bytes of workspace kvc::moment_kv_prefill needs (any alignment) for a cache with key extents `keys`.
template <Backend B, class Space, class T, Selector Sel, ObservationSet Obs>
std::size_t moment_kv_prefill_workspace_bytes(B const& backend, MomentKVScorer<Space, T> const& scorer,
                                              Sel const& selector, KVExtents const& keys, Obs const& obs) {
  std::size_t const scores = workspace_round(bytes_product(keys.rows(), sizeof(float)));
  std::size_t const plan = bytes_sum(workspace_round(bytes_product(keys.rows(), sizeof(Index))),
                                     workspace_round(bytes_product(2, keys.batch, keys.heads, sizeof(Index))));
  TokenArray<float, Space> const none{};
  auto const rounds = detail::round_selector<Space>(nullptr, keys.heads, 1, 0, 0);
  std::size_t step = score_workspace_bytes(backend, scorer.base, keys, obs);
  auto bigger = [&step](std::size_t x) { step = x > step ? x : step; };
  bigger(select_workspace_bytes(backend, selector, keys.batch, keys.heads, keys.tokens));
  bigger(score_workspace_bytes(backend, detail::with_fixed_base(scorer, none), keys, obs));
  bigger(select_workspace_bytes(backend, rounds, keys.batch, keys.heads, keys.tokens));
  bigger(on_evict_workspace_bytes(backend, scorer, keys));
  return bytes_sum(scores, scores, plan, step, workspace_slack);
}

/// Compresses a prefilled `cache` in place over scorer.prefill_rounds rounds (see the file comment), folding every
/// evicted token into scorer.state. `selector` sets the budgets (its n_sink and n_recent protect in every round);
/// `obs` are the window queries of the base score. The cache needs a per-head length table (compaction writes it).
template <Backend B, class T, Selector Sel, KVCacheView C, ObservationSet Obs>
Status moment_kv_prefill(B const& backend, MomentKVScorer<typename B::memory_space, T> const& scorer,
                         Sel const& selector, C const& cache, Obs const& obs, Workspace ws) {
  using Space = typename B::memory_space;
  KVC_RETURN_IF_ERROR(scorer.check());
  KVExtents const e = cache.keys.extents();
  KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::moment_kv_prefill", "the cache")));
  KVC_RETURN_IF_ERROR(detail::check_compactable_lengths(
      cache.lengths, e.heads,
      "kvc::moment_kv_prefill: the cache needs a per-head length table (heads may keep different counts)"));
  if (detail::overlaps_cache(detail::bytes_of(ws), cache))
    return {Errc::invalid_argument, "kvc::moment_kv_prefill: the workspace overlaps the cache's keys or values"};
  if (ws.bytes < moment_kv_prefill_workspace_bytes(backend, scorer, selector, e, obs))
    return {Errc::out_of_capacity,
            "kvc::moment_kv_prefill: workspace smaller than moment_kv_prefill_workspace_bytes()"};
  WorkspaceCarver carve(ws);
  TokenArray<float, Space> const base{carve.take<float>(e.rows()), e.batch, e.heads, e.tokens};
  ScoreSpan<Space> const mi{carve.take<float>(e.rows()), e.batch, e.heads, e.tokens};
  Index* const targets = carve.take<Index>(e.batch * e.heads);
  KeepPlan<Space> const plan{carve.take<Index>(e.rows()), carve.take<Index>(e.batch * e.heads), e.batch, e.heads,
                             e.tokens};
  Workspace const rest = carve.rest();

  // 1-2. The frozen base score and the budgets it gives (the selector's counts; its kept set is discarded).
  KVC_RETURN_IF_ERROR(
      score(backend, scorer.base, cache, obs, ScoreSpan<Space>{base.data, e.batch, e.heads, e.tokens}, rest));
  KVC_RETURN_IF_ERROR(select(backend, selector, ScoreSpan<Space>{base.data, e.batch, e.heads, e.tokens, cache.lengths},
                             KeepPlan<Space>{plan.index, targets, e.batch, e.heads, e.tokens}, rest));
  // 3. Rounds: MI scores under the current moments, an even share of the rest evicted, folded, compacted.
  auto const mi_scorer = detail::with_fixed_base(scorer, base);
  for (Index left = scorer.prefill_rounds; left >= 1; --left) {
    KVC_RETURN_IF_ERROR(score(backend, mi_scorer, cache, obs, mi, rest));
    auto const round = detail::round_selector<Space>(targets, e.heads, left, selector.n_sink, selector.n_recent);
    KVC_RETURN_IF_ERROR(
        select(backend, round, ScoreSpan<Space>{mi.data, e.batch, e.heads, e.tokens, cache.lengths}, plan, rest));
    KVC_RETURN_IF_ERROR(on_evict(backend, scorer, cache, plan, rest));
    KVC_RETURN_IF_ERROR(compact(backend, plan, cache, base, scorer.residuals.rows));
  }
  return {};
}

}  // namespace kvc
