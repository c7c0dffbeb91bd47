// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/key_diff.hpp: CPU reference kernel for KeyDiffScorer (the oracle for other backends).
#pragma once

#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/scorers/key_diff.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace kvc {

/// Two passes over K per (b, h): pass 1 sums unit keys into the anchor and stashes ||k_i|| in the output;
/// pass 2 turns each stashed norm into the cosine score. fp32 products, anchor summed in fp32 blocks of 256
/// tokens flushed into fp64 (so long caches do not lose the anchor's direction to rounding).
template <>
struct ScoreKernel<KeyDiffScorer, Cpu> {
  static constexpr Index block_tokens = 256;

  static std::size_t workspace_bytes(KeyDiffScorer const&, KVExtents const& keys) {
    auto const d = static_cast<std::size_t>(keys.dim);
    return 3 * workspace_round(d * sizeof(float)) + workspace_round(d * sizeof(double));
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const&, KeyDiffScorer const& s, C const& cache, Obs const&, ScoreSpan<HostSpace> out,
                    Workspace ws) {
    auto const& keys = cache.keys;
    KVExtents const e = keys.extents();
    WorkspaceCarver carve(ws);
    float* scratch = carve.take<float>(e.dim);
    float* block_sum = carve.take<float>(e.dim);
    float* anchor = carve.take<float>(e.dim);
    double* total = carve.take<double>(e.dim);
    if (total == nullptr && e.dim > 0)
      return {Errc::out_of_capacity, "kvc::score(key_diff): workspace smaller than score_workspace_bytes()"};
    Eigen::Map<Eigen::VectorXf> block(block_sum, e.dim), mu(anchor, e.dim);
    Eigen::Map<Eigen::VectorXd> sum(total, e.dim);
    bool const unit = s.anchor == KeyDiffAnchor::normalized_mean;

    for (Index b = 0; b < e.batch; ++b) {
      Index const n = out.length(b);
      if (n < 0 || n > e.tokens)
        return {Errc::invalid_argument, "kvc::score: `lengths[b]` must be in [0, tokens]"};
      for (Index h = 0; h < e.heads; ++h) {
        float* score = &out(b, h, 0);
        sum.setZero();
        for (Index t0 = 0; t0 < n; t0 += block_tokens) {
          block.setZero();
          for (Index t = t0; t < std::min(n, t0 + block_tokens); ++t) {
            auto const k = detail::float_row(keys.row(b, h, t), e.dim, scratch);
            float const norm = std::sqrt(k.squaredNorm());
            score[t] = norm;
            block += k * (unit ? 1.0f / std::max(norm, s.unit_eps) : 1.0f);
          }
          sum += block.cast<double>();
        }
        mu = (sum / static_cast<double>(std::max<Index>(n, 1))).cast<float>();
        float const mu_norm = std::max(mu.norm(), s.cosine_eps);
        for (Index t = 0; t < n; ++t) {
          auto const k = detail::float_row(keys.row(b, h, t), e.dim, scratch);
          score[t] = -k.dot(mu) / (mu_norm * std::max(score[t], s.cosine_eps));
        }
        std::fill(score + n, score + e.tokens, -std::numeric_limits<float>::infinity());
      }
    }
    return {};
  }
};

}  // namespace kvc
