// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/knorm.hpp: Knorm, the key-norm baseline (Devoto et al., "A Simple and Effective L2 Norm-Based
// Strategy for KV Cache Compression", EMNLP 2024; kvpress KnormPress).
//
//   s_i = -||k_i||_2   (higher = keep, so the lowest-norm keys are kept)
// Reads keys only. RoPE preserves norms, so pre- and post-RoPE keys give the same ranking.
#pragma once

#include <kvc/core/scorer.hpp>

#include <string_view>

namespace kvc {

/// Knorm scorer parameters (none besides the budget, which belongs to the selector).
struct KnormScorer {
  static constexpr Needs needs = Needs::keys;
  static constexpr std::string_view name = "knorm";
};

}  // namespace kvc
