// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/pipeline/query_statistics.hpp: CPU kernel of kvc::query_statistics.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/widen.hpp>
#include <kvc/pipeline/query_statistics.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstddef>

namespace kvc {

/// One (sequence, query head) per item. Pass 1 sums the sample rows in fp64 (the mean); pass 2 widens tiles of
/// centred rows and adds each tile's Gram product Xᵀ X (an Eigen GEMM in fp32, [d x tile] x [tile x d]) into an fp64
/// accumulator, so N = 128K samples lose no more than one tile's fp32 rounding. Centring first keeps the sum of
/// squares from cancelling when |mu| >> sigma (no E[xxᵀ] - mu muᵀ).
template <>
struct Kernel<QueryStatisticsStep, Cpu> {
  static constexpr Index tile = 64;  ///< rows per Gram product: [64 x 128] fp32 operands stay on Eigen's stack

  static std::size_t worker_bytes(Index dim) {
    return bytes_sum(workspace_round(bytes_product(tile, dim, sizeof(float))),
                     workspace_round(bytes_product(dim, dim, sizeof(float))),
                     workspace_round(bytes_product(dim, dim, sizeof(double))),
                     workspace_round(bytes_product(dim, sizeof(double))));
  }
  static std::size_t workspace_bytes(Cpu const& cpu, KVExtents const& q) {
    return bytes_product(cpu.workers(), worker_bytes(q.dim));
  }

  template <Element T>
  static Status run(Cpu const& cpu, TokenRows<T const, StridedLayout, HostSpace> const& queries, Index const* positions,
                    StatisticsRows const& sel, float* mean, float* covariance, Workspace ws) {
    using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    KVExtents const e = queries.extents();
    Index const d = e.dim, count = sel.count < 0 ? e.tokens : sel.count;
    std::size_t const per_worker = worker_bytes(d);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, e)));
    if (base == nullptr && e.batch * e.heads > 0)
      return {Errc::out_of_capacity,
              "kvc::query_statistics: workspace smaller than query_statistics_workspace_bytes()"};
    auto sample = [&](Index b, Index i) {
      return i >= sel.skip_rows && (positions ? positions[b * e.tokens + i] : i) >= sel.n_sink;
    };
    detail::parallel_for(cpu, e.batch * e.heads, [&](Index item, Index worker) {
      Index const b = item / e.heads, q = item % e.heads;
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      float* x = carve.take<float>(tile * d);
      float* gram = carve.take<float>(d * d);
      double* acc = carve.take<double>(d * d);
      double* sum = carve.take<double>(d);
      std::fill(sum, sum + d, 0.0);
      Index n = 0;
      for (Index i = 0; i < count; ++i)
        if (sample(b, i)) {
          T const* row = queries.row(b, q, i);
          for (Index c = 0; c < d; ++c)
            sum[c] += double{to_float(row[c])};
          ++n;
        }
      float* mu = mean + item * d;
      for (Index c = 0; c < d; ++c)
        mu[c] = n > 0 ? static_cast<float>(sum[c] / static_cast<double>(n)) : 0.0f;
      if (covariance == nullptr)
        return;
      std::fill(acc, acc + d * d, 0.0);
      Index rows = 0;
      auto flush = [&] {
        Eigen::Map<RowMatrix const> const xm(x, rows, d);
        Eigen::Map<RowMatrix> gm(gram, d, d);
        gm.noalias() = xm.transpose() * xm;
        for (Index c = 0; c < d * d; ++c)
          acc[c] += double{gram[c]};
        rows = 0;
      };
      for (Index i = 0; i < count; ++i) {
        if (!sample(b, i))
          continue;
        detail::widen(queries.row(b, q, i), x + rows * d, d);
        for (Index c = 0; c < d; ++c)
          x[rows * d + c] -= mu[c];
        if (++rows == tile)
          flush();
      }
      if (rows > 0)
        flush();
      float* cov = covariance + item * d * d;
      for (Index c = 0; c < d * d; ++c)
        cov[c] = n > 0 ? static_cast<float>(acc[c] / static_cast<double>(n)) : 0.0f;
    });
    return {};
  }
};

}  // namespace kvc
