// SPDX-License-Identifier: Apache-2.0
// kvc/pipeline/layer_stages.hpp: UNComp's layer groups ("stages") and hidden-state pruning at prefill (Xiong et al.,
// arXiv 2410.03090, §3.3.2, Eq. 8-10 and Alg. 2; the authors' uncomp/stage_division.py; decisions A8–A14 in
// docs/policies/uncomp.md#decisions). Host only, no allocation.
//
// Layer scores s_l (kvc's choice, A11: mean erank_k of the layer's heads; the threshold ε is in the same unit) fall
// with depth; a drop s_{l−1} − s_l > ε starts a new stage at layer l (Eq. 8 and the authors' code; Alg. 2's opposite
// sign is a typo), so there are 1 + #drops stages (Eq. 9 counts the drops). Stage c (0-based) keeps K_c hidden-state
// rows: K_0 = n, then K_c = max(min_tokens, n − c·step), chosen by the attention the last w queries pay them (summed
// over heads) with the last w rows always kept. Pruning happens at stage boundaries only; the kept rows keep their
// original positions (the caller gathers position ids with the same indices, so RoPE stays correct).
#pragma once

#include <kvc/core/extents.hpp>
#include <kvc/core/status.hpp>

#include <algorithm>
#include <cmath>
#include <utility>

namespace kvc {

/// Stages from layer scores layer_score [layers] (finite): a drop layer_score[l − 1] − layer_score[l] > epsilon
/// (epsilon >= 0, +inf allowed: one stage) starts a new stage at l. stage_of_layer [layers] receives contiguous,
/// non-decreasing values in [0, stages) starting at 0; `stages` = 1 + the number of such drops.
inline Status partition_layers(double const* layer_score /*[layers]*/, Index layers, double epsilon,
                               Index* stage_of_layer /*[layers]*/, Index& stages) noexcept {
  if (layers < 1)
    return {Errc::invalid_argument, "partition_layers: `layers` must be >= 1"};
  if (!(epsilon >= 0.0))
    return {Errc::invalid_argument, "partition_layers: `epsilon` must be >= 0 (or +inf)"};
  if (layer_score == nullptr || stage_of_layer == nullptr)
    return {Errc::invalid_argument, "partition_layers: `layer_score` and `stage_of_layer` must be non-null"};
  for (Index l = 0; l < layers; ++l)
    if (!std::isfinite(layer_score[l]))
      return {Errc::non_finite, "partition_layers: `layer_score` holds NaN or Inf"};
  Index stage = 0;
  stage_of_layer[0] = 0;
  for (Index l = 1; l < layers; ++l) {
    if (layer_score[l - 1] - layer_score[l] > epsilon)
      ++stage;
    stage_of_layer[l] = stage;
  }
  stages = stage + 1;
  return {};
}

/// Stages with a target count (decision A11): the (stages − 1) largest drops layer_score[l − 1] − layer_score[l],
/// l >= 1 (ties: lower layer; a "drop" may be negative when stages − 1 exceeds the real drops) start stages.
/// 1 <= stages <= layers; layer_score finite. stage_of_layer [layers] as for partition_layers. O(layers²).
inline Status partition_layers_count(double const* layer_score /*[layers]*/, Index layers, Index stages,
                                     Index* stage_of_layer /*[layers]*/) noexcept {
  if (layers < 1 || stages < 1 || stages > layers)
    return {Errc::invalid_argument, "partition_layers_count: need 1 <= `stages` <= `layers`"};
  if (layer_score == nullptr || stage_of_layer == nullptr)
    return {Errc::invalid_argument, "partition_layers_count: `layer_score` and `stage_of_layer` must be non-null"};
  for (Index l = 0; l < layers; ++l)
    if (!std::isfinite(layer_score[l]))
      return {Errc::non_finite, "partition_layers_count: `layer_score` holds NaN or Inf"};
  auto drop = [&](Index l) { return layer_score[l - 1] - layer_score[l]; };
  Index stage = 0;
  stage_of_layer[0] = 0;
  for (Index l = 1; l < layers; ++l) {
    Index rank = 0;  // drops ranked before l's: larger, or equal at a lower layer
    for (Index j = 1; j < layers; ++j)
      rank += (drop(j) > drop(l) || (drop(j) == drop(l) && j < l)) ? 1 : 0;
    if (rank < stages - 1)
      ++stage;
    stage_of_layer[l] = stage;
  }
  return {};
}

/// Hidden-state rows kept in each stage c (0-based), counts [stages]: K_0 = n, K_c = max(min_tokens, n − c·step),
/// never above n (decision A13: the code's floor 1536 and step, relative to the actual n). step <= 0 means the code's
/// default ⌊(n − min_tokens)/(stages − 1)⌋ (so K_{stages−1} = min_tokens + (n − min_tokens) mod (stages − 1)).
/// No pruning (every K_c = n) when n <= min_tokens. n >= 0, stages >= 1, min_tokens >= 0.
inline Status hidden_state_counts(Index n, Index stages, Index min_tokens, Index step,
                                  Index* counts /*[stages]*/) noexcept {
  if (n < 0 || stages < 1 || min_tokens < 0)
    return {Errc::invalid_argument, "hidden_state_counts: need `n` >= 0, `stages` >= 1 and `min_tokens` >= 0"};
  if (counts == nullptr)
    return {Errc::invalid_argument, "hidden_state_counts: `counts` must be non-null ([stages])"};
  if (step <= 0)
    step = stages > 1 && n > min_tokens ? (n - min_tokens) / (stages - 1) : 0;
  for (Index c = 0; c < stages; ++c) {
    if (n <= min_tokens) {
      counts[c] = n;
      continue;
    }
    // n − c·step without overflow: c·step can only exceed n − min_tokens when the result is min_tokens.
    Index const room = n - min_tokens;
    bool const floors = step > 0 && c > room / step;
    Index const k = floors ? min_tokens : n - c * step;
    counts[c] = k < min_tokens ? min_tokens : k;
  }
  return {};
}

namespace detail {
/// Hidden-state ranking: a before b when its score is larger, ties to the lower index.
inline bool hidden_state_before(float const* scores, Index a, Index b) noexcept {
  return scores[a] != scores[b] ? scores[a] > scores[b] : a < b;
}
}  // namespace detail

/// Kept hidden-state rows: the last min(window, n) rows always, plus the top rows of scores [n] (u_j: the attention
/// the last w queries pay row j, summed over heads, no pooling; NaN rejected) among the others, ties to the lower
/// index, up to kept = max(min(keep, n), min(window, n)) rows. out [min(n, max(keep, window))] receives them
/// ascending (unique, in [0, n)); `kept` receives the count. keep >= 0, window >= 0. O(n log keep), no allocation:
/// the selection is a heap inside `out`.
inline Status select_hidden_states(float const* scores /*[n]*/, Index n, Index keep, Index window,
                                   Index* out /*[min(n, max(keep, window))]*/, Index& kept) noexcept {
  if (n < 0 || keep < 0 || window < 0)
    return {Errc::invalid_argument, "select_hidden_states: `n`, `keep` and `window` must be >= 0"};
  if (n > 0 && (scores == nullptr || out == nullptr))
    return {Errc::invalid_argument, "select_hidden_states: `scores` ([n]) and `out` must be non-null"};
  for (Index j = 0; j < n; ++j)
    if (std::isnan(scores[j]))
      return {Errc::non_finite, "select_hidden_states: `scores` holds NaN"};
  Index const recent = std::min(window, n);
  Index const total = std::max(std::min(keep, n), recent);
  Index const prefix = n - recent;  // candidates [0, prefix)
  Index const m = total - recent;   // chosen among them
  // out[0, m) is a heap whose root is the worst kept candidate ("worse" = after in the ranking).
  auto worse_first = [&](Index a, Index b) { return detail::hidden_state_before(scores, a, b); };
  Index size = 0;
  for (Index j = 0; j < prefix && m > 0; ++j) {
    if (size < m) {
      out[size++] = j;
      std::push_heap(out, out + size, worse_first);
    } else if (detail::hidden_state_before(scores, j, out[0])) {
      std::pop_heap(out, out + size, worse_first);
      out[size - 1] = j;
      std::push_heap(out, out + size, worse_first);
    }
  }
  std::sort(out, out + m);
  for (Index i = 0; i < recent; ++i)
    out[m + i] = prefix + i;
  kept = total;
  return {};
}

}  // namespace kvc
