// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/key_diff.hpp: CPU reference kernel for KeyDiffScorer (the oracle for other backends).
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/scorers/key_diff.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace kvc {

/// Two passes over K per (b, h): pass 1 sums unit keys into the anchor and stashes ||k_i|| in the output;
/// pass 2 turns each stashed norm into the cosine score. fp32 products, anchor summed in fp32 blocks of 256
/// tokens flushed into fp64 (so long caches do not lose the anchor's direction to rounding). Pass 1 works in
/// tiles of 32 rows: all norms first (independent sqrt/div chains overlap), then the anchor updates from L1.
/// Range: a row whose fp32 sum of squares overflowed or underflowed (detail::sum_squares_in_range) goes into the
/// fp64 total directly with its fp64 norm, and pass 2 takes its cosine in fp64 (its stashed norm is outside
/// detail::norm_in_range); an anchor whose squared norm leaves [2^-64, 2^64] is first scaled by a power of two.
/// Both are rare per-row / per-head branches: the fp32 loops are unchanged, and every finite key scores right.
/// A key with a NaN or Inf element (its sum of squares is not finite, so it takes the rare path) is left out of the
/// anchor, which is the mean over the head's finite keys, and scores -inf: one bad token is evicted first instead
/// of turning every score of its head into NaN (docs/api_checks.md, "Non-finite keys").
template <>
struct Kernel<KeyDiffScorer, Cpu> {
  static constexpr Index tile_rows = 32;
  static constexpr Index block_tokens = 256;  // a multiple of tile_rows
  static_assert(block_tokens % tile_rows == 0);

  /// Pass 1's rare path: adds the row's unit (or raw) key to the fp64 total in fp64 and returns its fp64 norm
  /// rounded to fp32 (+inf above FLT_MAX; pass 2 recomputes it). A row with a NaN or Inf element (the only rows
  /// whose fp64 norm is not finite) is left out of the anchor, where it would make every element NaN or Inf and so
  /// every score of the head; it returns NaN (never a finite row's norm) for the caller to count it out.
  static float add_row_fp64(float const* k, Index dim, KeyDiffScorer const& s, double* total) noexcept {
    double const norm = std::sqrt(detail::sum_squares_fp64(k, dim));
    if (!std::isfinite(norm))
      return std::numeric_limits<float>::quiet_NaN();
    double const w = key_diff_anchor_weight(s, norm);
    for (Index i = 0; i < dim; ++i)
      total[i] += double{k[i]} * w;
    return static_cast<float>(norm);
  }

  /// The anchor's rare path, for ||mu||^2 outside [2^-64, 2^64] (the raw mean of huge or tiny keys, or unit keys
  /// that nearly cancel): mu = total / n scaled by 2^e so its largest element lies in [1, 2), which keeps pass 2's
  /// fp32 products in range. The cosine is scale-invariant and the eps floor scales with mu: returns
  /// max(||mu||, eps) * 2^e (+inf only when ||mu|| is below 2^-150, where every score rounds to 0 anyway).
  static float scale_anchor(double const* total, double n, Index dim, float eps, float* anchor) noexcept {
    int top = std::numeric_limits<int>::min();
    for (Index i = 0; i < dim; ++i)
      if (total[i] != 0.0)
        top = std::max(top, std::ilogb(total[i] / n));
    int const e = top == std::numeric_limits<int>::min() ? 0 : -top;
    double mu_sq = 0.0;
    for (Index i = 0; i < dim; ++i) {
      anchor[i] = static_cast<float>(std::ldexp(total[i] / n, e));
      mu_sq += double{anchor[i]} * anchor[i];
    }
    return std::max(static_cast<float>(std::sqrt(mu_sq)), static_cast<float>(std::ldexp(double{eps}, e)));
  }

  /// Per worker: one tile of widened rows, the block sum, the anchor and the fp64 total.
  static std::size_t worker_bytes(Index dim) {
    std::size_t const row = workspace_round(bytes_product(dim, sizeof(float)));
    return bytes_sum(workspace_round(bytes_product(tile_rows, dim, sizeof(float))), row, row,
                     workspace_round(bytes_product(dim, sizeof(double))));
  }
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, KeyDiffScorer const&, KVExtents const& keys, Obs const&) {
    return bytes_product(cpu.workers(), worker_bytes(keys.dim));
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, KeyDiffScorer const& s, C const& cache, Obs const&, ScoreSpan<HostSpace> out,
                    Workspace ws) {
    auto const& keys = cache.keys;
    KVExtents const e = keys.extents();
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, s, e, 0)));
    if (base == nullptr && e.dim > 0)
      return {Errc::out_of_capacity, "kvc::score(key_diff): workspace smaller than score_workspace_bytes()"};

    return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index worker) {
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * worker_bytes(e.dim), worker_bytes(e.dim)});
      float* scratch = carve.take<float>(tile_rows * e.dim);  // widened 16-bit rows of one tile
      float* block_sum = carve.take<float>(e.dim);
      float* anchor = carve.take<float>(e.dim);
      double* total = carve.take<double>(e.dim);
      std::fill(total, total + e.dim, 0.0);
      Index skipped = 0;  // non-finite keys, left out of the anchor's mean
      auto const scale = keys.scale(b, h);
      for (Index t0 = 0; t0 < n; t0 += block_tokens) {
        std::fill(block_sum, block_sum + e.dim, 0.0f);
        for (Index tile = t0; tile < std::min(n, t0 + block_tokens); tile += tile_rows) {
          Index const rows = std::min(n - tile, tile_rows);
          float const* k[tile_rows];
          float weight[tile_rows];
          for (Index r = 0; r < rows; ++r) {
            k[r] = detail::float_row(keys.row(b, h, tile + r), e.dim, scratch + r * e.dim, scale).data();
            float const sq = detail::dot(k[r], k[r], e.dim);
            if (detail::sum_squares_in_range(sq)) [[likely]] {
              float const norm = std::sqrt(sq);
              score[tile + r] = norm;
              weight[r] = key_diff_anchor_weight(s, norm);
            } else {
              score[tile + r] = add_row_fp64(k[r], e.dim, s, total);
              skipped += std::isnan(score[tile + r]) ? 1 : 0;
              weight[r] = 0.0f;  // already in total, or left out
            }
          }
          for (Index r = 0; r < rows; ++r)
            if (weight[r] != 0.0f)  // 0 only for rows of the rare path: 0 x NaN would still reach the anchor
              detail::axpy(block_sum, k[r], weight[r], e.dim);
        }
        for (Index i = 0; i < e.dim; ++i)
          total[i] += block_sum[i];
      }
      auto const count = static_cast<double>(std::max<Index>(n - skipped, 1));
      double mu_sq = 0.0;
      for (Index i = 0; i < e.dim; ++i) {
        anchor[i] = static_cast<float>(total[i] / count);
        mu_sq += double{anchor[i]} * anchor[i];
      }
      float mu_norm = std::max(static_cast<float>(std::sqrt(mu_sq)), s.cosine_eps);
      if (!(mu_sq >= 0x1p-64 && mu_sq <= 0x1p64)) [[unlikely]]
        mu_norm = scale_anchor(total, count, e.dim, s.cosine_eps, anchor);
      for (Index t = 0; t < n; ++t) {
        auto const* row = keys.row(b, h, t);
        if (detail::norm_in_range(score[t])) [[likely]] {
          score[t] = key_diff_cosine(s, detail::dot(row, anchor, e.dim, scale), mu_norm, score[t]);
        } else {
          auto const [dot, squares] = detail::dot_squares_fp64(row, anchor, e.dim, scale);
          score[t] = std::isfinite(squares)  // a NaN or Inf key has no direction: evicted first
                         ? static_cast<float>(key_diff_cosine(s, dot, double{mu_norm}, std::sqrt(squares)))
                         : -std::numeric_limits<float>::infinity();
        }
      }
    });
  }
};

}  // namespace kvc
