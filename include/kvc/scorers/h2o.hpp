// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/h2o.hpp: H2O, Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative
// Inference of Large Language Models", arXiv 2306.14048), and kvpress's one-shot ObservedAttentionPress.
// Code: FMInference/H2O h2o_hf/utils_real_drop/modify_llama.py (the authors'), NVIDIA/kvpress
// kvpress/presses/observed_attention_press.py; docs/policies/h2o.md.
//
// H2OScorer (the authors' real-drop cache, variant (a), the default): every cached token accumulates the attention
// it receives while cached, from its own step on. With P(q, i, j) the causal fp32 softmax of query row i of query
// head q over the slots of KV head (b, h):
//   acc[j] += (1/g) sum_{q in group(h)} sum_i P(q, i, j)      (kvc::update, every prefill chunk and decode step)
//   s[j]    = acc[j]                                            (kvc::score)
// The GQA mean is the library's extension (the authors' code is MHA-only; it ranks as the group sum).
// Heavy hitters plus a recent window is TopKSelector{FixedBudget{hh + recent}, 0, recent}: the last `recent` slots
// are protected and the rest compete on acc. The state lives in caller-owned buffers (H2OState): the accumulator
// travels through kvc::compact as an extra TokenArray, and `tracked` counts the slots whose accumulator holds data
// (kvc::on_evict sets it to the kept count; kvc::update zeroes newly appended slots before adding). An engine that
// already has attention column sums passes them (Observations::attention) instead of queries.
//
// ObservedAttentionScorer (kvpress's ObservedAttentionPress, `reference=kvpress` in the tools): one-shot, stateless:
//   s[j] = (1/g) sum_q (sum_i P(q, i, j)) / |{i : query i sees slot j}|    (mean attention received; N - j in
// prefill), from the window queries (every prompt query), computed in tiles of `query_tile` rows so the N x N
// attention is never held: extra memory O(g * query_tile * (d + 128) + g * N) floats per worker.
#pragma once

#include <kvc/core/kv_view.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/core/status.hpp>
#include <kvc/scorers/reference.hpp>

#include <string_view>
#include <tuple>

namespace kvc {

/// H2O's caller-owned state for one layer: the accumulator [batch, Hkv, capacity] (fp32, slots as in the cache)
/// and `tracked` [batch, Hkv] (slots [0, tracked) of a head hold accumulated attention). Zero `tracked` to start.
template <class Space = HostSpace>
struct H2OState {
  using memory_space = Space;

  TokenArray<float, Space> accumulated{};
  Index* tracked = nullptr;
};

/// The authors' H2O: scores are the accumulated attention (see the file comment). Stateful.
template <class Space = HostSpace>
struct H2OScorer {
  static constexpr Needs needs = Needs::keys;  ///< score reads the state; update reads window queries or attention
  static constexpr std::string_view name = "h2o";
  static constexpr bool stateful = true;

  H2OState<Space> state{};
  Index query_tile = 256;  ///< query rows per window-attention pass in kvc::update (bounds its scratch)

  constexpr Status check() const noexcept {
    if (query_tile < 1)
      return {Errc::invalid_argument, "H2OScorer: `query_tile` must be >= 1"};
    return {};
  }
};

H2OScorer()->H2OScorer<HostSpace>;

/// kvpress's ObservedAttentionPress: mean attention received over the window queries that see each slot.
struct ObservedAttentionScorer {
  static constexpr Needs needs = Needs::keys | Needs::window_queries;
  static constexpr std::string_view name = "h2o";  ///< the tools' `h2o` with reference=kvpress

  Index query_tile = 256;  ///< window query rows per pass (peak scratch O(g * query_tile * 128) floats)

  constexpr Status check() const noexcept {
    if (query_tile < 1)
      return {Errc::invalid_argument, "ObservedAttentionScorer: `query_tile` must be >= 1"};
    return {};
  }
};

/// H2O as the tools and presses configure it: which scorer (H2OScorer or ObservedAttentionScorer) and the share of
/// the kept budget the top-k selection reserves for the newest tokens (the authors' recent window; kvpress's
/// ObservedAttentionPress has none). The selection keeps max(n_recent, floor(recent_share x kept)) recent slots.
struct H2OPolicy {
  static constexpr std::string_view name = "h2o";

  Reference reference = Reference::authors;  ///< authors: H2OScorer; kvpress: ObservedAttentionScorer
  double recent_share = 0.5;                 ///< in [0, 1]: the authors' heavy / recent split is half and half

  /// kvpress's ObservedAttentionPress: no recent window.
  static constexpr H2OPolicy kvpress() noexcept { return {Reference::kvpress, 0.0}; }

  /// The parameters the tools expose (core/params.hpp).
  static constexpr auto parameters() noexcept {
    return std::tuple{
        named_param("reference", &H2OPolicy::reference, reference_names,
                    "authors (raw accumulated attention, recent window) or kvpress (ObservedAttentionPress: mean "
                    "attention received, no window)"),
        number_param("recent_share", &H2OPolicy::recent_share, 0.0, 1.0,
                     "fraction of the kept budget reserved for the most recent tokens (compress only)")};
  }

  constexpr Status check() const noexcept {
    if (!(recent_share >= 0.0 && recent_share <= 1.0))
      return {Errc::invalid_argument, "H2OPolicy: `recent_share` must be in [0, 1]"};
    return {};
  }
};

/// H2O's accumulator of one slot after an update (the file comment's acc[j] +=): `acc` (0 for a slot appended since
/// the last update) plus col(q) / g for each query head q < g of the KV head's group, added in query-head order, with
/// col(q) the attention head q paid the slot. Host and device: both backends' kvc::update call it.
template <class Col>
KVC_HOST_DEVICE float h2o_accumulate(float acc, Index g, Col const& col) noexcept {
  for (Index q = 0; q < g; ++q)
    acc += col(q) / static_cast<float>(g);
  return acc;
}

/// ObservedAttention's score of one slot: the group's attention col(q) summed in query-head order, divided by g and
/// then by the `seen` window queries at or after the slot's position (0 when none sees it). Host and device.
template <class Col>
KVC_HOST_DEVICE float observed_attention_score(Index g, Index seen, Col const& col) noexcept {
  float sum = 0.0f;
  for (Index q = 0; q < g; ++q)
    sum += col(q);
  return seen > 0 ? sum / static_cast<float>(g) / static_cast<float>(seen) : 0.0f;
}

}  // namespace kvc
