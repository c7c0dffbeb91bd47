// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/key_diff.hpp: CPU reference kernel for KeyDiffScorer (the oracle for other backends).
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/scorers/key_diff.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace kvc {

/// Two passes over K per (b, h): pass 1 sums unit keys into the anchor and stashes ||k_i|| in the output;
/// pass 2 turns each stashed norm into the cosine score. fp32 products, anchor summed in fp32 blocks of 256
/// tokens flushed into fp64 (so long caches do not lose the anchor's direction to rounding). Pass 1 works in
/// tiles of 32 rows: all norms first (independent sqrt/div chains overlap), then the anchor updates from L1.
template <>
struct Kernel<KeyDiffScorer, Cpu> {
  static constexpr Index tile_rows = 32;
  static constexpr Index block_tokens = 256;  // a multiple of tile_rows
  static_assert(block_tokens % tile_rows == 0);

  /// Per worker: one tile of widened rows, the block sum, the anchor and the fp64 total.
  static std::size_t worker_bytes(Index dim) {
    auto const d = static_cast<std::size_t>(dim);
    return workspace_round(tile_rows * d * sizeof(float)) + 2 * workspace_round(d * sizeof(float)) +
           workspace_round(d * sizeof(double));
  }
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, KeyDiffScorer const&, KVExtents const& keys, Obs const&) {
    return static_cast<std::size_t>(cpu.workers()) * worker_bytes(keys.dim);
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, KeyDiffScorer const& s, C const& cache, Obs const&, ScoreSpan<HostSpace> out,
                    Workspace ws) {
    auto const& keys = cache.keys;
    KVExtents const e = keys.extents();
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, s, e, 0)));
    if (base == nullptr && e.dim > 0)
      return {Errc::out_of_capacity, "kvc::score(key_diff): workspace smaller than score_workspace_bytes()"};
    bool const unit = s.anchor == KeyDiffAnchor::normalized_mean;

    return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index worker) {
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * worker_bytes(e.dim), worker_bytes(e.dim)});
      float* scratch = carve.take<float>(tile_rows * e.dim);  // widened 16-bit rows of one tile
      float* block_sum = carve.take<float>(e.dim);
      float* anchor = carve.take<float>(e.dim);
      double* total = carve.take<double>(e.dim);
      std::fill(total, total + e.dim, 0.0);
      for (Index t0 = 0; t0 < n; t0 += block_tokens) {
        std::fill(block_sum, block_sum + e.dim, 0.0f);
        for (Index tile = t0; tile < std::min(n, t0 + block_tokens); tile += tile_rows) {
          Index const rows = std::min(n - tile, tile_rows);
          float const* k[tile_rows];
          float weight[tile_rows];
          for (Index r = 0; r < rows; ++r) {
            k[r] = detail::float_row(keys.row(b, h, tile + r), e.dim, scratch + r * e.dim).data();
            float const norm = std::sqrt(detail::dot(k[r], k[r], e.dim));
            score[tile + r] = norm;
            weight[r] = unit ? 1.0f / std::max(norm, s.unit_eps) : 1.0f;
          }
          for (Index r = 0; r < rows; ++r)
            detail::axpy(block_sum, k[r], weight[r], e.dim);
        }
        for (Index i = 0; i < e.dim; ++i)
          total[i] += block_sum[i];
      }
      double mu_sq = 0.0;
      for (Index i = 0; i < e.dim; ++i) {
        anchor[i] = static_cast<float>(total[i] / static_cast<double>(std::max<Index>(n, 1)));
        mu_sq += double{anchor[i]} * anchor[i];
      }
      float const mu_norm = std::max(static_cast<float>(std::sqrt(mu_sq)), s.cosine_eps);
      for (Index t = 0; t < n; ++t) {
        score[t] = -detail::dot(keys.row(b, h, t), anchor, e.dim) / (mu_norm * std::max(score[t], s.cosine_eps));
      }
    });
  }
};

}  // namespace kvc
