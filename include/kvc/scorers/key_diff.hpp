// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/key_diff.hpp: KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for
// Long-Context LLM Inference in Resource-Constrained Environments", arXiv 2504.15364), paper Eq. 8.
//
// Keeps the keys that point away from the head's anchor, the mean of its L2-normalised keys:
//   k^_i = k_i / max(||k_i||, 1e-12),   mu = (1/n) sum_i k^_i,
//   s_i  = -(mu . k_i) / (max(||mu||, eps) * max(||k_i||, eps)),   eps = 1e-8   (higher = keep)
// Reads keys only (as stored: post-RoPE in Hugging Face caches). Scores lie in [-1, 1]; a zero key, or mu = 0,
// scores 0. The anchor is recomputed from the n valid keys on every call (KeyDiff is stateless).
#pragma once

#include <kvc/core/params.hpp>
#include <kvc/core/scorer.hpp>

#include <cstdint>
#include <string_view>
#include <tuple>

namespace kvc {

/// Which anchor the cosine is measured against (paper Table 2 ablation; docs/policies/key_diff.md#decisions).
enum class KeyDiffAnchor : std::uint8_t {
  normalized_mean,  ///< mean of unit keys, paper Eq. 8 and kvpress (default)
  raw_mean,         ///< mean of raw keys, which the paper's §3.2 calls equivalent; invariant only to one global scale
};

/// KeyDiff scorer parameters. Pair it with TopKSelector{FixedBudget{N}} and the block-wise driver for the
/// paper's protocol, or TopKSelector{RatioBudget{r}} for kvpress's one-shot KeyDiffPress.
struct KeyDiffScorer {
  static constexpr Needs needs = Needs::keys;
  static constexpr std::string_view name = "key_diff";

  KeyDiffAnchor anchor = KeyDiffAnchor::normalized_mean;
  float unit_eps = 1e-12f;   ///< floor on ||k|| when normalising keys for the anchor (F.normalize)
  float cosine_eps = 1e-8f;  ///< floor on ||mu|| and ||k|| in the cosine (torch.cosine_similarity)

  /// The parameters the tools expose (core/params.hpp).
  static constexpr auto parameters() noexcept {
    return std::tuple{
        named_param("anchor", &KeyDiffScorer::anchor,
                    {{"normalized_mean", KeyDiffAnchor::normalized_mean}, {"raw_mean", KeyDiffAnchor::raw_mean}},
                    "normalized_mean (paper, kvpress) or raw_mean")};
  }
};

/// The weight of key k_i in the anchor's sum (fp32, or fp64 on the range paths): 1 / max(||k_i||, unit_eps) for the
/// normalised mean, 1 for the raw one. Host and device: both backends' anchor passes call it.
template <class Real>
KVC_HOST_DEVICE constexpr Real key_diff_anchor_weight(KeyDiffScorer const& s, Real norm) noexcept {
  Real const eps = static_cast<Real>(s.unit_eps);
  return s.anchor == KeyDiffAnchor::normalized_mean ? Real{1} / (norm < eps ? eps : norm) : Real{1};
}

/// KeyDiff's score of a finite key from its dot with the anchor, mu_norm = max(||mu||, cosine_eps) (scaled with the
/// anchor when it was scaled) and ||k||: -dot / (mu_norm * max(||k||, cosine_eps)). A key with a NaN or Inf element
/// has no direction: it is left out of the anchor's mean and scores -inf on both backends. Host and device.
template <class Real>
KVC_HOST_DEVICE constexpr Real key_diff_cosine(KeyDiffScorer const& s, Real dot, Real mu_norm, Real norm) noexcept {
  Real const eps = static_cast<Real>(s.cosine_eps);
  return -dot / (mu_norm * (norm < eps ? eps : norm));
}

}  // namespace kvc
