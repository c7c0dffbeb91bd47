// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/tova.hpp: TOVA, Token Omission Via Attention (Oren et al., "Transformers are Multi-State RNNs",
// arXiv 2401.06104): keep the tokens the newest query attends to most, averaged over all heads.
//
// With P(q, j) the fp32 softmax of the last window query (query head q, at position p) over the n valid slots of
// sequence b, causal by position, including the query's own token:
//   s[j] = (1 / Hq) sum_{q < Hq} P(q, j)       (every query head; the same score for every KV head)
//   authors (default): nothing is protected; the newest token competes and may be evicted.
//   kvpress (TOVAPress): the slots at or after position p (the newest token) score max_{j' before} s + 1.
// Every KV head of a sequence must hold the same slots (TOVA evicts one shared set per layer), so heads of one
// sequence must have equal lengths. Higher = keep. The authors' budget is the absolute cache size M
// (TopKSelector{FixedBudget{M}}); kvpress's ratio is TopKSelector{RatioBudget{r}}.
#pragma once

#include <kvc/core/scorer.hpp>
#include <kvc/scorers/reference.hpp>
#include <kvc/scorers/snap_kv.hpp>

#include <string_view>

namespace kvc {

/// TOVA parameters (kvpress's TOVAPress has none besides the ratio).
struct TOVAScorer {
  static constexpr Needs needs = Needs::keys | Needs::window_queries;
  static constexpr std::string_view name = "tova";

  Reference reference = Reference::authors;

  constexpr Status check() const noexcept { return {}; }
};

/// TOVA's score of one slot before protection: the attention col(q) of every query head q < Hq of the sequence,
/// summed in query-head order, divided by Hq. Host and device: both backends' TOVA kernels call it.
template <class Col>
KVC_HOST_DEVICE float tova_score(Index query_heads, Col const& col) noexcept {
  float sum = 0.0f;
  for (Index q = 0; q < query_heads; ++q)
    sum += col(q);
  return sum / static_cast<float>(query_heads);
}

}  // namespace kvc
