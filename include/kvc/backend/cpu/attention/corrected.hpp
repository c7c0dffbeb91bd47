// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/attention/corrected.hpp: the CPU epilogue of MomentKV's corrected attention: per KV head, the
// query rows of its G query heads in tiles, T = Q C̃ᵀ as one Eigen product (C̃ is read once per tile, not once per
// query head), then the log-domain merge of each row with its retained state (scorers/moments.hpp).
#pragma once

#include <kvc/attention/corrected.hpp>
#include <kvc/backend/cpu/detail/attend.hpp>
#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/moments.hpp>
#include <kvc/backend/cpu/detail/rows.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>

namespace kvc {

namespace detail {

/// t[i, a] = Σ_x C̃[a, x] q[i, x] for NQ <= 4 query rows (C̃ = C with |x| < tau zeroed; C [dv, dk] in storage type
/// T; a 16-bit row is first widened into `row_buf` [dk] by the bulk conversion): each row of C is read once for all
/// NQ rows and the clamp is a select on the loaded lanes, so a decode step streams C once (no clamped copy, no
/// packing). Fixed-size Eigen arrays keep the NQ accumulators in vector registers; the lane order is fixed, so
/// results are deterministic.
template <std::size_t NQ, class T>
inline void comoment_times_queries(T const* c, Index dv, Index dk, float tau, float const* q, float* t, Index t_stride,
                                   float* row_buf) noexcept {
  using Vec16 = Eigen::Array<float, 16, 1>;
  Index const whole = dk / 16 * 16;
  for (Index a = 0; a < dv; ++a) {
    float const* row;
    if constexpr (std::is_same_v<T, float>) {
      row = c + a * dk;
    } else {
      widen(c + a * dk, row_buf, dk);
      row = row_buf;
    }
    Vec16 acc[NQ];
    for (Vec16& lanes : acc)
      lanes.setZero();
    for (Index x = 0; x < whole; x += 16) {
      Vec16 cr = Eigen::Map<Vec16 const>(row + x);
      cr = (cr.abs() < tau).select(Vec16::Zero(), cr);
      for (std::size_t i = 0; i < NQ; ++i)
        acc[i] += cr * Eigen::Map<Vec16 const>(q + static_cast<Index>(i) * dk + x);
    }
    for (std::size_t i = 0; i < NQ; ++i) {
      Index const qi = static_cast<Index>(i);
      float sum = acc[i].sum();
      for (Index x = whole; x < dk; ++x)
        sum += clamp_small(row[x], tau) * q[qi * dk + x];
      t[qi * t_stride + a] = sum;
    }
  }
}

/// comoment_times_queries over nq <= 4 rows (dispatch to the fixed count).
template <class T>
inline void comoment_times_queries(T const* c, Index dv, Index dk, float tau, float const* q, Index nq, float* t,
                                   Index t_stride, float* row_buf) noexcept {
  switch (nq) {
    case 1: return comoment_times_queries<1>(c, dv, dk, tau, q, t, t_stride, row_buf);
    case 2: return comoment_times_queries<2>(c, dv, dk, tau, q, t, t_stride, row_buf);
    case 3: return comoment_times_queries<3>(c, dv, dk, tau, q, t, t_stride, row_buf);
    default: return comoment_times_queries<4>(c, dv, dk, tau, q, t, t_stride, row_buf);
  }
}

}  // namespace detail

template <>
struct Kernel<CorrectedAttention, Cpu> {
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  static constexpr Index tile = detail::moment_tile;  ///< query rows per pass
  /// Up to this many rows in a pass (decode: G query heads x 1 row), C̃q is a matvec that reads C once per 4 rows
  /// (detail::comoment_times_queries): an Eigen product would first pack the whole of C, which costs more than the
  /// few dot products it feeds. More rows (a prefill chunk) take the product over a clamped fp32 copy of C.
  static constexpr Index direct_rows = 16;

  /// Per worker: C̃ [dv, dk] (the product path), k̄ and v̄ [dk + dv], a query tile [tile, dk],
  /// T [tile, dv] and f̂_E [dv], fp32.
  static std::size_t worker_bytes(Index dk, Index dv) {
    return bytes_sum(
        workspace_round(bytes_product(dv, dk, sizeof(float))), workspace_round(bytes_product(dk + dv, sizeof(float))),
        workspace_round(bytes_product(tile, dk, sizeof(float))),
        workspace_round(bytes_product(tile, dv, sizeof(float))), workspace_round(bytes_product(dv, sizeof(float))));
  }
  template <class Q, KVCacheView C, class MT>
  static std::size_t workspace_bytes(Cpu const& cpu, CorrectedAttention const&, Q const&, C const& cache,
                                     MomentState<HostSpace, MT> const&) {
    return bytes_product(cpu.workers(), worker_bytes(cache.keys.extents().dim, cache.values.extents().dim));
  }

  template <class Q, KVCacheView C, class MT>
  static Status run(Cpu const& cpu, CorrectedAttention const& op, Q const& queries, C const& cache,
                    MomentState<HostSpace, MT> const& moments, float* out, float* lse, Workspace ws) {
    KVExtents const q = queries.rows.extents(), k = cache.keys.extents();
    Index const dk = k.dim, dv = cache.values.extents().dim, group = q.heads / k.heads, rows = group * q.tokens;
    float const c = op.attention.scale > 0.0f ? op.attention.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    std::size_t const per_worker = worker_bytes(dk, dv);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(bytes_product(cpu.workers(), per_worker)));
    if (base == nullptr && q.rows() > 0)
      return {Errc::out_of_capacity,
              "kvc::attend_corrected: workspace smaller than attend_corrected_workspace_bytes()"};
    bool const first = op.order == MomentOrder::first;
    detail::parallel_for(cpu, k.batch * k.heads, [&](Index item, Index worker) {
      Index const b = item / k.heads, g = item % k.heads;
      Index const ne = moments.count[moments.head(b, g)];
      if (ne <= 0)
        return;  // nothing evicted: the retained attention is exact
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      float* ct = carve.take<float>(dv * dk);
      float* km = carve.take<float>(dk + dv);
      float* vm = km + dk;
      float* qt = carve.take<float>(tile * dk);
      float* tt = carve.take<float>(tile * dv);
      float* est = carve.take<float>(dv);
      detail::widen(moments.key_mean_of(b, g), km, dk);
      detail::widen(moments.value_mean_of(b, g), vm, dv);
      MT const* cm = moments.comoment_of(b, g);
      bool copied = false;  // ct holds C̃ (the product path, formed once per KV head)
      float const log_n = std::log(static_cast<float>(ne)), beta = c / static_cast<float>(ne);
      Index const chunk = detail::moment_row_chunk(dk);
      // Row r of the group: query head g * group + r / n, query r % n (the heads' rows are contiguous in `out`).
      for (Index r0 = 0; r0 < rows; r0 += tile) {
        Index const nr = std::min(tile, rows - r0);
        for (Index i = 0; i < nr; ++i) {
          Index const r = r0 + i;
          detail::widen(queries.rows.row(b, g * group + r / q.tokens, r % q.tokens), qt + i * dk, dk);
        }
        if (first && nr <= direct_rows) {  // T[i, a] = C̃[a, :] q_i, C read once per 4 rows
          for (Index i0 = 0; i0 < nr; i0 += 4)
            detail::comoment_times_queries(cm, dv, dk, op.clamp_tau, qt + i0 * dk, std::min<Index>(4, nr - i0),
                                           tt + i0 * dv, dv, ct);  // ct: a row buffer here
        } else if (first) {                                        // T[:, a0:a1] = Q C̃[a0:a1, :]ᵀ
          if (!copied) {
            detail::widen(cm, ct, dv * dk);
            detail::clamped_comoment(ct, dv * dk, op.clamp_tau, ct);
            copied = true;
          }
          Eigen::Map<RowMatrix const> const qm(qt, nr, dk);
          Eigen::Map<RowMatrix> tm(tt, nr, dv);
          for (Index a0 = 0; a0 < dv; a0 += chunk) {
            Index const ac = std::min(chunk, dv - a0);
            tm.middleCols(a0, ac).noalias() = qm * Eigen::Map<RowMatrix const>(ct + a0 * dk, ac, dk).transpose();
          }
        }
        for (Index i = 0; i < nr; ++i) {
          Index const r = r0 + i, row = (b * q.heads + g * group + r / q.tokens) * q.tokens + r % q.tokens;
          float const dot = detail::dot(km, qt + i * dk, dk);  // qᵀk̄
          for (Index a = 0; a < dv; ++a)
            est[a] = vm[a] + (first ? beta * tt[i * dv + a] : 0.0f);
          lse[row] = detail::merge_evicted<float>(out + row * dv, lse[row], est, log_n + c * dot, dv);
        }
      }
    });
    return {};
  }
};

}  // namespace kvc
