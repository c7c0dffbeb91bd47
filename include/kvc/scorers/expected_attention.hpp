// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/expected_attention.hpp: Expected Attention (Devoto, Jeblick and Jégou, "Expected Attention: KV Cache
// Compression by Estimating Attention from Future Queries Distribution", arXiv 2510.00636; kvpress's
// ExpectedAttentionPress). Future queries are modelled as Gaussian; the attention they will pay each key has a
// closed form, so no attention matrix is ever formed. Decisions A1–A22: docs/policies/expected_attention.md.
//
// Inputs: per query head q the mean mu_q [d] and covariance Sigma_q [d, d] of PRE-RoPE query samples
// (kvc::query_statistics builds them), post-RoPE keys and the values. For KV head (b, h) with n valid slots:
//   R̄       = (1/T) sum_{p = t0}^{t0 + T - 1} R_p, from the RoPE table: per pair a scaled rotation (Eq. 6)
//   mū, Σ̄  = R̄ mu_q,  R̄ Sigma_q R̄ᵀ                       (Σ̄ = 0 when use_covariance is false)
//   λ_q[j]  = s mū·k_j + (s²/2) k_jᵀ Σ̄ k_j                    (Eq. 7; s = scale, default 1/sqrt(d))
//   â_q[j]  = softmax over j in I of λ_q                       (Eq. 8; I = slots [n_sink, n), or all with
//                                                               normalize_sinks)
//   ā[j]    = mean (or max) over the group's query heads of â_q[j]
//   s[j]    = (ā[j] + epsilon) ||v_j||_2  if use_vnorm, else ā[j]                       (Eq. 9, ||v|| for ||W_o v||)
//   sinks   : slots j < n_sink score (max over every (b, h) and non-sink slot of s) + 1, so top-k keeps them.
// t0, the first future position (Eq. 6, decision A1): authors (default) the absolute position of the next token,
// QueryStatistics::next_position (absent: one past the largest position in the cache); reference=kvpress,
// QueryStatistics::observed (the number of query rows the statistics summarise: the context length in prefill,
// the hidden-state buffer's length while decoding, which is what kvpress's `hidden_states.shape[1]` gives).
// Ties in selection keep the lower slot (the selector's rule). Higher = keep. The paper runs it under AdaKV's
// head-adaptive budgets; TopKSelector gives kvpress's uniform per-head ScorerPress.
#pragma once

#include <kvc/core/params.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/core/status.hpp>
#include <kvc/scorers/reference.hpp>
#include <kvc/scorers/snap_kv.hpp>  // GqaReduce

#include <cmath>
#include <string_view>
#include <tuple>

namespace kvc {

/// ExpectedAttention parameters (field names follow kvpress's ExpectedAttentionPress).
struct ExpectedAttentionScorer {
  static constexpr Needs needs = Needs::keys | Needs::values | Needs::query_statistics;
  static constexpr std::string_view name = "expected_attention";

  Reference reference = Reference::authors;  ///< only changes t0 (see the file comment, decision A1)
  Index n_future_positions = 512;            ///< T: R̄ averages RoPE over positions [t0, t0 + T)
  Index n_sink = 4;                          ///< first slots: not scored, outside the softmax, always kept
  bool use_covariance = true;                ///< the (s²/2) kᵀΣ̄k term of Eq. 7
  bool use_vnorm = true;                     ///< weight by ||v|| (Eq. 9); epsilon is ignored without it
  float epsilon = 0.01f;                     ///< the paper's 0.01 (kvpress's class default is 0)
  GqaReduce gqa = GqaReduce::mean;           ///< mean of probabilities (kvpress) or max (decision A6)
  bool normalize_sinks = false;              ///< softmax over every slot, sinks included (Eq. 8 as printed; A5)
  float scale = 0.0f;                        ///< softmax scale s; 0 means 1/sqrt(head dim) (A14)

  constexpr Status check() const noexcept {
    if (n_future_positions < 1)
      return {Errc::invalid_argument, "ExpectedAttentionScorer: `n_future_positions` must be >= 1"};
    if (n_sink < 0)
      return {Errc::invalid_argument, "ExpectedAttentionScorer: `n_sink` must be >= 0"};
    if (!(epsilon >= 0.0f) || !(epsilon < INFINITY))
      return {Errc::invalid_argument, "ExpectedAttentionScorer: `epsilon` must be finite and >= 0"};
    if (gqa != GqaReduce::mean && gqa != GqaReduce::max)
      return {Errc::invalid_argument, "ExpectedAttentionScorer: `gqa` must be mean or max"};
    if (!(scale >= 0.0f) || !(scale < INFINITY))
      return {Errc::invalid_argument, "ExpectedAttentionScorer: `scale` must be finite and >= 0 (0: 1/sqrt(d))"};
    return {};
  }

  /// kvpress's ExpectedAttentionPress: t0 from the number of query rows, its class default epsilon 0.
  static constexpr ExpectedAttentionScorer kvpress() noexcept {
    ExpectedAttentionScorer s;
    s.reference = Reference::kvpress;
    s.epsilon = 0.0f;
    return s;
  }

  /// The parameters the tools expose (core/params.hpp; the defaults above, kvpress()'s under reference=kvpress).
  static constexpr auto parameters() noexcept {
    using S = ExpectedAttentionScorer;
    return std::tuple{
        named_param("reference", &S::reference, reference_names,
                    "authors (future RoPE from the next absolute position) or kvpress (from the number of query "
                    "rows, ExpectedAttentionPress; with its class default epsilon 0)"),
        number_param("n_future_positions", &S::n_future_positions, 1, max_param_index,
                     "T: RoPE averaged over the next T positions"),
        number_param("n_sink", &S::n_sink, 0, max_param_index,
                     "first tokens: left out of the statistics and the softmax, always kept"),
        flag_param("use_covariance", &S::use_covariance, "true or false: the k^T Sigma k / 2d term of Eq. 7"),
        flag_param("use_vnorm", &S::use_vnorm, "true or false: weight by ||v|| (Eq. 9); needs --values"),
        number_param("epsilon", &S::epsilon, 0, 1e30, "added to the attention before the ||v|| weighting (paper 0.01)"),
        named_param("gqa", &S::gqa, {{"mean", GqaReduce::mean}, {"max", GqaReduce::max}},
                    "mean (kvpress) or max of the group's probabilities"),
        flag_param("normalize_sinks", &S::normalize_sinks,
                   "true: the softmax runs over the sinks too (Eq. 8 as printed)")};
  }
};

/// The score of a non-sink slot from its group's probabilities combined by gqa_combine (`combined`: their sum, or
/// their maximum) and its value norm ||v_j|| (read only with use_vnorm): ā = the sum / g for gqa=mean, then
/// (ā + ε) ||v_j|| (the file comment). Host and device: both backends' last step.
KVC_HOST_DEVICE constexpr float expected_attention_score(ExpectedAttentionScorer const& s, Index g, float combined,
                                                         float value_norm) noexcept {
  float const a = s.gqa == GqaReduce::mean ? combined / static_cast<float>(g) : combined;
  return s.use_vnorm ? (a + s.epsilon) * value_norm : a;
}

/// The sinks' score: above every other slot of every head (`top` their largest, -inf when there is none): kvpress's
/// max + 1, 0 + 1 when nothing else is scored.
KVC_HOST_DEVICE constexpr float expected_attention_sink_score(float top) noexcept {
  return (top == -INFINITY ? 0.0f : top) + 1.0f;  // the macro: numeric_limits is host-only under nvcc
}

}  // namespace kvc
