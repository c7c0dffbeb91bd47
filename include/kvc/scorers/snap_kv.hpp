// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/snap_kv.hpp: SnapKV (Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
// arXiv 2404.14469): the last w queries (the observation window) vote for the prefix keys they attend to.
//
// For KV head (b, h) with n valid slots, the window keys are the slots at or after the first window query's
// position (the window's own tokens); the prefix is the m slots before them. With P(q, i, j) the causal fp32
// softmax of window query i of query head q over the n slots (scale 1/sqrt(d)):
//   authors (default; SnapKV code, KVCache-Factory kv_head granularity):
//     v_q[j] = sum_i P(q, i, j);  r[j] = gqa_reduce_{q in group(h)} v_q[j];  s[j] = pool_k(r)[j]      (j < m)
//   kvpress (SnapKVPress):
//     v_q[j] = mean_i P(q, i, j); s[j] = mean_{q in group(h)} pool_k(v_q)[j]                              (j < m)
//   window slots (j >= m): s[j] = max_{j' < m} s[j'] + 1 (0 + 1 for an empty prefix), so any top-k keeps them.
// pool_k: stride 1, padding k/2, k odd; max pads with -inf; avg pads with zeros counted in the mean
// (count_include_pad), so edge values are damped as in PyTorch. Higher = keep.
// Budgets: the authors' absolute capacity C (window included) is TopKSelector{FixedBudget{C}} (no compression when
// n <= C); kvpress's ratio r is TopKSelector{RatioBudget{r}}.
#pragma once

#include <kvc/core/scorer.hpp>
#include <kvc/core/status.hpp>
#include <kvc/scorers/reference.hpp>

#include <cstdint>
#include <string_view>

namespace kvc {

/// 1-D pooling of scores along the token axis.
enum class Pooling : std::uint8_t {
  max,         ///< sliding max, kernel k (odd), stride 1 (the authors')
  avg,         ///< sliding mean, kernel k (odd), zero padding counted (kvpress's)
  chunk_mean,  ///< aligned chunks [c·k, (c+1)·k) of the prefix: each slot gets its chunk's mean (MomentKV's "chunks
               ///< of size 4"; a last partial chunk averages its own slots); any k >= 1
};

/// How scores of the g query heads of a KV head are combined into one score per KV head.
enum class GqaReduce : std::uint8_t {
  mean,
  max,
  sum,
  per_query_head,  ///< no reduction: the authors' expanded storage, for caches with one KV head per query head
};

/// SnapKV parameters (field names follow kvpress's SnapKVPress where the concept is the same).
struct SnapKVScorer {
  static constexpr Needs needs = Needs::keys | Needs::window_queries;
  static constexpr std::string_view name = "snap_kv";

  Reference reference = Reference::authors;
  Index window_size = 32;  ///< observation window w: the last w rows of the window queries (authors 32, kvpress 64)
  Index kernel_size = 7;   ///< pooling kernel, odd (authors 7, kvpress 5)
  Pooling pooling = Pooling::max;   ///< authors max, kvpress avg
  GqaReduce gqa = GqaReduce::mean;  ///< authors: reduced before pooling; kvpress: mean after pooling (fixed)

  /// kvpress's SnapKVPress defaults: w = 64, kernel 5, avg pooling, mean over the window and the group.
  static constexpr SnapKVScorer kvpress() noexcept {
    return {Reference::kvpress, 64, 5, Pooling::avg, GqaReduce::mean};
  }

  constexpr Status check() const noexcept {
    if (window_size < 1)
      return {Errc::invalid_argument, "SnapKVScorer: `window_size` must be >= 1"};
    if (kernel_size < 1 || (kernel_size % 2 == 0 && pooling != Pooling::chunk_mean))
      return {Errc::invalid_argument,
              "SnapKVScorer: `kernel_size` must be odd and >= 1 (an even kernel shifts scores; chunk_mean takes any)"};
    if (reference == Reference::kvpress && gqa != GqaReduce::mean)
      return {Errc::invalid_argument, "SnapKVScorer: reference=kvpress averages over the GQA group (gqa=mean)"};
    return {};
  }
};

}  // namespace kvc
