// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/press.hpp: a Press is a scorer plus a selector; kvc::compress runs score then select.
#pragma once

#include <kvc/core/checks.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/core/selector.hpp>
#include <kvc/core/workspace.hpp>

#include <cstddef>

namespace kvc {

/// The composition users hold, e.g. Press{KeyDiffScorer{}, TopKSelector<RatioBudget>{{0.5}}}.
template <Scorer S, Selector Sel>
struct Press {
  S scorer;
  Sel selector;
};

template <Scorer S, Selector Sel>
Press(S, Sel) -> Press<S, Sel>;

/// Bytes of workspace kvc::compress needs (any alignment): the fp32 score tensor, then the scorer's and the
/// selector's scratch.
template <Backend B, Scorer S, Selector Sel, ObservationSet Obs = NoObservations>
std::size_t compress_workspace_bytes(B const& backend, Press<S, Sel> const& press, KVExtents const& keys,
                                     Obs const& obs = {}) {
  return bytes_sum(
      workspace_round(bytes_product(keys.batch, keys.heads, keys.tokens, sizeof(float))),
      workspace_round(score_workspace_bytes(backend, press.scorer, keys, obs)),
      workspace_round(select_workspace_bytes(backend, press.selector, keys.batch, keys.heads, keys.tokens)),
      workspace_slack);
}

/// One-shot compression decision: scores every token, then selects into `plan` (nothing is moved; follow with
/// kvc::compact or hand the plan to the engine's allocator). `obs` carries the scorer's observations.
template <Backend B, Scorer S, Selector Sel, KVCacheView C, ObservationSet Obs>
Status compress(B const& backend, Press<S, Sel> const& press, C const& cache, Obs const& obs,
                KeepPlan<typename B::memory_space> plan, Workspace ws) {
  KVExtents const e = cache.keys.extents();
  // First: the carve below multiplies the extents (then score and select check the rest).
  KVC_RETURN_IF_ERROR(detail::check_cache(cache, KVC_CACHE_MESSAGES("kvc::compress", "the cache")));
  if (detail::overlaps_cache(detail::bytes_of(plan), cache))
    return {Errc::invalid_argument, "kvc::compress: `plan` overlaps the cache's keys or values"};
  if (detail::overlaps_cache(detail::bytes_of(ws), cache))
    return {Errc::invalid_argument, "kvc::compress: the workspace overlaps the cache's keys or values"};
  WorkspaceCarver carve(ws);
  float* scores = carve.take<float>(e.rows());
  std::size_t const score_bytes = workspace_round(score_workspace_bytes(backend, press.scorer, e, obs));
  std::size_t const select_bytes =
      workspace_round(select_workspace_bytes(backend, press.selector, e.batch, e.heads, e.tokens));
  void* score_ws = carve.take<std::byte>(static_cast<Index>(score_bytes));
  void* select_ws = carve.take<std::byte>(static_cast<Index>(select_bytes));
  if ((scores == nullptr && e.rows() > 0) || (score_ws == nullptr && score_bytes > 0) ||
      (select_ws == nullptr && select_bytes > 0))
    return {Errc::out_of_capacity, "kvc::compress: workspace smaller than compress_workspace_bytes()"};
  ScoreSpan<typename B::memory_space> span{scores, e.batch, e.heads, e.tokens, cache.lengths};
  // The scores are the press's own scratch; score() reads the cache, the observations and the scorer only.
  KVC_RETURN_IF_ERROR(score(backend, press.scorer, cache, obs, span, Workspace{score_ws, score_bytes}));
  return select(backend, press.selector, span, plan, Workspace{select_ws, select_bytes});
}

/// kvc::compress for scorers that read only keys and values.
template <Backend B, Scorer S, Selector Sel, KVCacheView C>
Status compress(B const& backend, Press<S, Sel> const& press, C const& cache, KeepPlan<typename B::memory_space> plan,
                Workspace ws) {
  static_assert(needs_only_kv(S::needs), "kvc::compress: this scorer needs observations; pass them as `obs`");
  return compress(backend, press, cache, NoObservations{}, plan, ws);
}

}  // namespace kvc
