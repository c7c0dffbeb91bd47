// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/knorm.hpp: Knorm, the key-norm baseline (Devoto et al., "A Simple and Effective L2 Norm-Based
// Strategy for KV Cache Compression", EMNLP 2024; kvpress KnormPress).
//
//   s_i = -||k_i||_2   (higher = keep, so the lowest-norm keys are kept)
// Reads keys only. RoPE preserves norms, so pre- and post-RoPE keys give the same ranking.
#pragma once

#include <kvc/core/scorer.hpp>

#include <cmath>
#include <string_view>

namespace kvc {

/// Knorm scorer parameters (none besides the budget, which belongs to the selector).
struct KnormScorer {
  static constexpr Needs needs = Needs::keys;
  static constexpr std::string_view name = "knorm";
};

/// Knorm's score of a key whose fp32 sum of squares left the range (detail::sum_squares_in_range), from its fp64 sum
/// of squares: -sqrt(sq) rounded to fp32 (-inf past FLT_MAX, as for an Inf element), and -inf for a NaN key too (its
/// norm is undefined: evicted first, never a NaN score). Host and device: both backends' range paths call it.
KVC_HOST_DEVICE inline float knorm_fp64_score(double sum_squares) noexcept {
  return sum_squares != sum_squares ? -__builtin_huge_valf() : -static_cast<float>(sqrt(sum_squares));
}

}  // namespace kvc
