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
#include <tuple>

namespace kvc {

/// TOVA parameters (kvpress's TOVAPress has none besides the ratio).
struct TOVAScorer {
  static constexpr Needs needs = Needs::keys | Needs::window_queries;
  static constexpr std::string_view name = "tova";

  Reference reference = Reference::authors;

  constexpr Status check() const noexcept { return {}; }

  /// kvpress's TOVAPress.
  static constexpr TOVAScorer kvpress() noexcept { return {Reference::kvpress}; }

  /// The parameters the tools expose (core/params.hpp).
  static constexpr auto parameters() noexcept {
    return std::tuple{named_param("reference", &TOVAScorer::reference, reference_names,
                                  "authors (the newest token competes) or kvpress (TOVAPress: it is always kept)")};
  }
};

/// TOVA's score of one slot before protection is the mean of its attention over every query head of the sequence,
/// summed in query-head order from 0 and divided by Hq, written in two steps so that a backend may sum one KV head's
/// group at a time: tova_add_group adds col(q) of the group's g heads (in order) to `sum`, tova_mean divides the total.
/// Host and device: both backends' TOVA kernels call them.
template <class Col>
KVC_HOST_DEVICE float tova_add_group(float sum, Index g, Col const& col) noexcept {
  for (Index q = 0; q < g; ++q)
    sum += col(q);
  return sum;
}

KVC_HOST_DEVICE constexpr float tova_mean(float sum, Index query_heads) noexcept {
  return sum / static_cast<float>(query_heads);
}

}  // namespace kvc
