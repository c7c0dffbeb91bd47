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

#include <kvc/core/params.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/core/status.hpp>
#include <kvc/scorers/reference.hpp>

#include <cstdint>
#include <string_view>
#include <tuple>

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

/// The pooled value of slot j of a prefix of m slots, x(t) the values (the Pooling definitions above; max is the first
/// largest, as std::max_element). Host and device: both backends' SnapKV, UNComp and MomentKV base scores call it.
template <class X>
KVC_HOST_DEVICE float pooled_at(Pooling pooling, Index k, Index m, Index j, X const& x) noexcept {
  Index lo = 0, hi = 0;
  float divisor = static_cast<float>(k);
  if (pooling == Pooling::chunk_mean) {  // the aligned chunk holding j, over its own slots
    lo = j / k * k;
    hi = lo + k < m ? lo + k : m;
    divisor = static_cast<float>(hi - lo);
  } else {  // centred on j, padding k / 2 (avg counts the padding: it divides by k)
    Index const r = k / 2;
    lo = j - r < 0 ? 0 : j - r;
    hi = j + r + 1 < m ? j + r + 1 : m;
  }
  if (pooling == Pooling::max) {
    float v = x(lo);
    for (Index t = lo + 1; t < hi; ++t)
      v = v < x(t) ? x(t) : v;
    return v;
  }
  float sum = 0.0f;
  for (Index t = lo; t < hi; ++t)
    sum += x(t);
  return sum / divisor;
}

/// One step of a group reduction in query-head order: `acc` so far and query head q's value x (q = 0 starts it).
/// max keeps the larger (std::max's order), mean and sum add (the division is the caller's, once).
KVC_HOST_DEVICE constexpr float gqa_combine(GqaReduce gqa, Index q, float acc, float x) noexcept {
  return q == 0 ? x : (gqa == GqaReduce::max ? (acc < x ? x : acc) : acc + x);
}

/// The votes v(q) of the g query heads of a KV head combined by `gqa` (per_query_head: g = 1, the vote itself), in
/// query-head order.
template <class V>
KVC_HOST_DEVICE float reduce_group(GqaReduce gqa, Index g, V const& v) noexcept {
  float acc = 0.0f;
  for (Index q = 0; q < g; ++q)
    acc = gqa_combine(gqa, q, acc, v(q));
  return gqa == GqaReduce::mean ? acc / static_cast<float>(g) : acc;
}

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

  /// The parameters the tools expose (core/params.hpp; the defaults above, kvpress()'s under reference=kvpress).
  static constexpr auto parameters() noexcept {
    return std::tuple{named_param("reference", &SnapKVScorer::reference, reference_names,
                                  "authors (paper code) or kvpress (SnapKVPress, with the kvpress defaults below)"),
                      number_param("window_size", &SnapKVScorer::window_size, 1, max_param_index,
                                   "observation window w: the last w rows of --queries vote"),
                      number_param("kernel_size", &SnapKVScorer::kernel_size, 1, max_param_index,
                                   "pooling kernel along the tokens, odd"),
                      named_param("pooling", &SnapKVScorer::pooling, {{"max", Pooling::max}, {"avg", Pooling::avg}},
                                  "max or avg (avg always divides by kernel_size, as PyTorch)"),
                      named_param("gqa", &SnapKVScorer::gqa,
                                  {{"mean", GqaReduce::mean},
                                   {"max", GqaReduce::max},
                                   {"sum", GqaReduce::sum},
                                   {"per_query_head", GqaReduce::per_query_head}},
                                  "GQA reduction: mean, max, sum or per_query_head (Hq = Hkv); kvpress: mean")};
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

/// SnapKV's score of prefix slot j < m (the file comment's formulas, in this order of operations on every backend):
/// col(q, t) is the window's vote for slot t of query head q of the group (the sum over the w window rows of
/// P(q, i, t)), g the query heads per KV head. The window slots [m, n) then get protected_score.
template <class Col>
KVC_HOST_DEVICE float snap_kv_score(SnapKVScorer const& s, Index g, Index m, Index j, Col const& col) noexcept {
  if (s.reference == Reference::authors)  // the group's votes reduced, then pooled
    return pooled_at(s.pooling, s.kernel_size, m, j,
                     [&](Index t) { return reduce_group(s.gqa, g, [&](Index q) { return col(q, t); }); });
  float const per_vote = 1.0f / static_cast<float>(s.window_size * g);  // kvpress: each head's mean pooled, averaged
  float v = 0.0f;
  for (Index q = 0; q < g; ++q)
    v += pooled_at(s.pooling, s.kernel_size, m, j, [&](Index t) { return col(q, t); }) * per_vote;
  return v;
}

}  // namespace kvc
