// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/attention/attend.hpp: CPU attention kernel and the full-vs-compressed error measurement.
#pragma once

#include <kvc/attention/attend.hpp>
#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/rows.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace kvc {

/// One (sequence, KV head) per item: its g query heads x n queries, two passes over the head's slots per query
/// (logits into scratch, then the max-shifted softmax-weighted sum of values). fp32 products and sums.
template <>
struct Kernel<Attention, Cpu> {
  /// Per worker: one logit per slot, one widened query row, one widened value row.
  static std::size_t worker_bytes(Index tokens, Index dk, Index dv) {
    return bytes_sum(workspace_round(bytes_product(tokens, sizeof(float))),
                     workspace_round(bytes_product(dk, sizeof(float))),
                     workspace_round(bytes_product(dv, sizeof(float))));
  }
  template <class Q, KVCacheView C>
  static std::size_t workspace_bytes(Cpu const& cpu, Attention const&, Q const&, C const& cache) {
    return bytes_product(
        cpu.workers(), worker_bytes(cache.keys.extents().tokens, cache.keys.extents().dim, cache.values.extents().dim));
  }

  template <Element T, KVCacheView C>
  static Status run(Cpu const& cpu, Attention const& op, AttendQueries<T, HostSpace> const& queries, C const& cache,
                    AttendOutput<HostSpace> out, Workspace ws) {
    KVExtents const q = queries.rows.extents(), k = cache.keys.extents();
    Index const dv = cache.values.extents().dim;
    std::size_t const per_worker = worker_bytes(k.tokens, k.dim, dv);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, op, queries, cache)));
    if (base == nullptr)
      return {Errc::out_of_capacity, "kvc::attend: workspace smaller than attend_workspace_bytes()"};
    KVC_RETURN_IF_ERROR(detail::check_lengths(cache.lengths, k.batch, k.heads, k.tokens,
                                              "kvc::attend: every valid length must be in [0, tokens]"));
    float const scale = op.scale > 0 ? op.scale : 1.0f / std::sqrt(static_cast<float>(k.dim));
    Index const group = q.heads / k.heads;
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();

    detail::parallel_for(cpu, k.batch * k.heads, [&](Index item, Index worker) {
      Index const b = item / k.heads, h = item % k.heads, n = cache.length(b, h);
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      float* logits = carve.take<float>(k.tokens);
      float* q_row = carve.take<float>(k.dim);
      float* v_row = carve.take<float>(dv);
      Index const end = queries.positions ? 0 : context_end(cache, b);
      for (Index hq = h * group; hq < (h + 1) * group; ++hq)
        for (Index i = 0; i < q.tokens; ++i) {
          auto const* src = queries.rows.row(b, hq, i);
          for (Index c = 0; c < k.dim; ++c)
            q_row[c] = to_float(src[c]);
          Index const q_pos = queries.positions ? queries.positions[b * q.tokens + i] : end - q.tokens + i;
          float peak = neg_inf;
          for (Index j = 0; j < n; ++j) {
            bool const visible = !op.causal || cache.position(b, h, j) <= q_pos;
            logits[j] = visible ? scale * detail::dot(cache.keys.row(b, h, j), q_row, k.dim) : neg_inf;
            peak = std::max(peak, logits[j]);
          }
          Eigen::Map<Eigen::VectorXf> o(out.out + ((b * q.heads + hq) * q.tokens + i) * dv, dv);
          o.setZero();
          float denom = 0.0f;
          if (peak > neg_inf) {
            for (Index j = 0; j < n; ++j) {
              float const w = std::exp(logits[j] - peak);  // exp(-inf) = 0 for masked slots
              if (w == 0.0f)
                continue;
              denom += w;
              o += w * detail::float_row(cache.values.row(b, h, j), dv, v_row);
            }
            o /= denom;
          }
          if (out.lse)
            out.lse[(b * q.heads + hq) * q.tokens + i] = denom > 0 ? peak + std::log(denom) : neg_inf;
        }
    });
    return {};
  }
};

/// Relative L2 error ||O_compressed - O_full|| / ||O_full|| of attention outputs over all queries and heads, between
/// `full` and `compressed` (host caches; the compressed one carries its positions, so the causal mask is the same).
/// A measurement helper for tests, tools and the demo: it allocates its buffers, so keep it out of hot paths.
template <Element T, KVCacheView Full, KVCacheView Compressed>
Status attention_error(AttendQueries<T, HostSpace> const& queries, Full const& full, Compressed const& compressed,
                       double& relative_error, Attention op = {}) {
  KVExtents const q = queries.rows.extents();
  Index const dv = full.values.extents().dim;
  auto const outputs = static_cast<std::size_t>(q.batch * q.heads * q.tokens * dv);
  std::vector<float> a(outputs), b(outputs);
  std::vector<Index> positions;  // both caches answer the same queries, at the full context's last positions
  AttendQueries<T, HostSpace> fixed = queries;
  if (!queries.positions) {
    for (Index s = 0; s < q.batch; ++s)
      for (Index i = 0; i < q.tokens; ++i)
        positions.push_back(context_end(full, s) - q.tokens + i);
    fixed.positions = positions.data();
  }
  std::vector<std::byte> ws(std::max(attend_workspace_bytes(Cpu{}, op, queries, full),
                                     attend_workspace_bytes(Cpu{}, op, queries, compressed)));
  KVC_RETURN_IF_ERROR(attend(Cpu{}, op, fixed, full, AttendOutput<>{a.data()}, {ws.data(), ws.size()}));
  KVC_RETURN_IF_ERROR(attend(Cpu{}, op, fixed, compressed, AttendOutput<>{b.data()}, {ws.data(), ws.size()}));
  double num = 0, den = 0;
  for (std::size_t i = 0; i < outputs; ++i) {
    num += (double{b[i]} - a[i]) * (double{b[i]} - a[i]);
    den += double{a[i]} * a[i];
  }
  relative_error = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return {};
}

}  // namespace kvc
