// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/moment_kv.hpp: CPU kernels of MomentKVScorer: the MI score (SnapKV's window attention,
// then α_j ‖r_j‖ with r = V − v̄ − (c/n) K C̃ᵀ as Eigen products over tiles of slots) and the moment update on
// eviction (the evicted rows' block moments as one product of centred tiles, then Chan's merge).
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/moments.hpp>
#include <kvc/backend/cpu/detail/widen.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/pipeline/compact.hpp>  // validate_plan
#include <kvc/scorers/moment_kv.hpp>
#include <kvc/scorers/moments.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <type_traits>

namespace kvc {

template <class T>
struct Kernel<MomentKVScorer<HostSpace, T>, Cpu> {
  using Scorer = MomentKVScorer<HostSpace, T>;
  using Base = Kernel<SnapKVScorer, Cpu>;
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

  /// Per worker for the residual: C̃ [dv, dk], the 16-bit state's copy, a K tile, a V tile and U = K C̃ᵀ [tile, dv].
  static std::size_t residual_bytes(Index dk, Index dv) {
    constexpr Index t = detail::moment_tile;
    return bytes_sum(workspace_round(bytes_product(dv, dk, sizeof(float))),
                     workspace_round(bytes_product(detail::moment_copy_floats<T>(dk, dv), sizeof(float))),
                     workspace_round(bytes_product(t, dk, sizeof(float))),
                     workspace_round(bytes_product(t, dv, sizeof(float))),
                     workspace_round(bytes_product(t, dv, sizeof(float))));
  }
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, Scorer const& s, KVExtents const& keys, Obs const& obs) {
    std::size_t const base = s.fixed_base.data ? 0 : Base::workspace_bytes(cpu, s.base, keys, obs);
    // The residual pass does not know d_v from the key extents: size it for d_v = the state's value dim.
    std::size_t const mine = bytes_product(cpu.workers(), residual_bytes(keys.dim, s.state.value_dim));
    return base > mine ? base : mine;
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, Scorer const& s, C const& cache, Obs const& obs, ScoreSpan<HostSpace> out,
                    Workspace ws) {
    KVC_RETURN_IF_ERROR(s.check());
    KVExtents const e = cache.keys.extents();
    Index const dk = e.dim, dv = cache.values.extents().dim;
    KVC_RETURN_IF_ERROR(s.state.check(e.batch, e.heads, dk, dv));
    if (s.residuals.enabled())
      KVC_RETURN_IF_ERROR(check_residuals(s.residuals, e, dv));
    if (s.fixed_base.data) {
      if (s.fixed_base.batch != e.batch || s.fixed_base.heads != e.heads || s.fixed_base.tokens < e.tokens)
        return {Errc::invalid_argument, "kvc::score(moment_kv): `fixed_base` must be [batch, heads, >= tokens]"};
      auto const copy_base = [&](Index b, Index h, Index n, float* score, Index) {
        std::copy(s.fixed_base.row(b, h), s.fixed_base.row(b, h) + n, score);
      };
      KVC_RETURN_IF_ERROR(detail::for_each_head(cpu, out, copy_base));
    } else {
      KVC_RETURN_IF_ERROR(Base::run(cpu, s.base, cache, obs, out, ws));
    }
    if (!s.mi)  // the base alone
      return {};
    std::size_t const per_worker = residual_bytes(dk, dv);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(bytes_product(cpu.workers(), per_worker)));
    if (base == nullptr && e.batch * e.heads > 0)
      return {Errc::out_of_capacity, "kvc::score(moment_kv): workspace smaller than score_workspace_bytes()"};
    float const c = s.scale > 0.0f ? s.scale : 1.0f / std::sqrt(static_cast<float>(dk));
    detail::parallel_for(cpu, e.batch * e.heads, [&](Index item, Index worker) {
      Index const b = item / e.heads, h = item % e.heads;
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      float* ct = carve.take<float>(dv * dk);
      float* copy = carve.take<float>(detail::moment_copy_floats<T>(dk, dv));
      float* kt = carve.take<float>(detail::moment_tile * dk);
      float* vt = carve.take<float>(detail::moment_tile * dv);
      float* ut = carve.take<float>(detail::moment_tile * dv);
      residual_head(s, cache, b, h, out.length(b, h), c, out.row(b, h), ct, copy, kt, vt, ut);
    });
    return {};
  }

  /// score[j] = kvc::moment_mi_score(score[j], ‖r_j‖²) for the n valid slots of head (b, h): α_j ‖r_j‖; a NaN
  /// residual scores -inf unless the base protects the slot (+inf); otherwise a zero or +inf base stays as is.
  template <KVCacheView C>
  static void residual_head(Scorer const& s, C const& cache, Index b, Index h, Index n, float c, float* score,
                            float* ct, float* copy, float* kt, float* vt, float* ut) {
    Index const dk = cache.keys.extents().dim, dv = cache.values.extents().dim;
    Index const ne = s.state.count[s.state.head(b, h)];
    // The u_j cache when every row is valid (then no clamp: C is not re-formed), else C̃ k_j per tile.
    bool const cached = s.residuals.enabled() && s.residuals.tracked[s.state.head(b, h)] == n;
    detail::MomentsF32<T> m{};
    float beta = 0.0f;
    if (ne > 0) {
      m = detail::load_moments(s.state, b, h, copy);
      if (!cached)
        detail::clamped_comoment(m.comoment, dv * dk, s.clamp_tau, ct);
      beta = c / static_cast<float>(ne);
    }
    Index const chunk = detail::moment_row_chunk(dk);
    for (Index t0 = 0; t0 < n; t0 += detail::moment_tile) {
      Index const rows = std::min(detail::moment_tile, n - t0);
      detail::load_rows(cache.values, b, h, nullptr, t0, rows, dv, vt);
      if (ne > 0 && cached) {
        for (Index i = 0; i < rows; ++i)
          std::copy_n(s.residuals.rows.row(b, h, t0 + i), dv, ut + i * dv);
      } else if (ne > 0) {
        detail::load_rows(cache.keys, b, h, nullptr, t0, rows, dk, kt);
        Eigen::Map<RowMatrix const> const km(kt, rows, dk);
        Eigen::Map<RowMatrix> um(ut, rows, dv);
        for (Index a0 = 0; a0 < dv; a0 += chunk) {  // U[:, a0:a1] = K C̃[a0:a1, :]ᵀ
          Index const ac = std::min(chunk, dv - a0);
          um.middleCols(a0, ac).noalias() = km * Eigen::Map<RowMatrix const>(ct + a0 * dk, ac, dk).transpose();
        }
      }
      for (Index i = 0; i < rows; ++i) {
        float* v = vt + i * dv;
        float ss = 0.0f;
        if (ne > 0) {
          float const* u = ut + i * dv;
          for (Index a = 0; a < dv; ++a) {
            float const r = moment_residual(v[a], m.value_mean[a], beta, u[a]);
            ss += r * r;
          }
        } else {
          for (Index a = 0; a < dv; ++a)
            ss += v[a] * v[a];
        }
        score[t0 + i] = moment_mi_score(score[t0 + i], ss);
      }
    }
  }

  /// Per worker for the u_j rows: the 16-bit state's copy and a K tile.
  static std::size_t rows_bytes(Index dk, Index dv) {
    return bytes_sum(workspace_round(bytes_product(detail::moment_copy_floats<T>(dk, dv), sizeof(float))),
                     workspace_round(bytes_product(detail::moment_tile, dk, sizeof(float))));
  }
  template <class Obs>
  static std::size_t update_workspace_bytes(Cpu const& cpu, Scorer const& s, KVExtents const& keys, Obs const&) {
    return s.residuals.enabled() ? bytes_product(cpu.workers(), rows_bytes(keys.dim, s.state.value_dim)) : 0;
  }

  /// The moments hold evicted tokens only, so arriving tokens change them not; with the u_j cache, the rows of the
  /// new slots [tracked, length) are computed (u_j = C k_j, O(d²) each) and tracked = length.
  template <KVCacheView C, class Obs>
  static Status update(Cpu const& cpu, Scorer const& s, C const& cache, Obs const&, Workspace ws) {
    if (!s.residuals.enabled())
      return {};
    KVExtents const e = cache.keys.extents();
    Index const dk = e.dim, dv = cache.values.extents().dim;
    KVC_RETURN_IF_ERROR(s.check());
    KVC_RETURN_IF_ERROR(s.state.check(e.batch, e.heads, dk, dv));
    KVC_RETURN_IF_ERROR(check_residuals(s.residuals, e, dv));
    std::size_t const per_worker = rows_bytes(dk, dv);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(bytes_product(cpu.workers(), per_worker)));
    if (base == nullptr && e.batch * e.heads > 0)
      return {Errc::out_of_capacity, "kvc::update(moment_kv): workspace smaller than update_workspace_bytes()"};
    detail::parallel_for(cpu, e.batch * e.heads, [&](Index item, Index worker) {
      Index const b = item / e.heads, h = item % e.heads, n = cache.length(b, h);
      Index& tracked = s.residuals.tracked[s.state.head(b, h)];
      Index const from = tracked >= 0 && tracked <= n ? tracked : 0;
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      float* copy = carve.take<float>(detail::moment_copy_floats<T>(dk, dv));
      float* kt = carve.take<float>(detail::moment_tile * dk);
      detail::MomentsF32<T> const m = detail::load_moments(s.state, b, h, copy);
      fill_rows(s.residuals.rows, cache, b, h, nullptr, from, n - from, m.comoment, kt);
      tracked = n;
    });
    return {};
  }

  static Status check_residuals(MomentResiduals<HostSpace> const& r, KVExtents const& e, Index dv) {
    KVExtents const x = r.rows.extents();
    if (x.batch != e.batch || x.heads != e.heads || x.tokens < e.tokens || x.dim != dv)
      return {Errc::invalid_argument, "MomentKVScorer: `residuals.rows` must be [batch, heads, >= tokens, d_v]"};
    return {};
  }

  /// u rows of `count` slots (slots[i], or from + i when `slots` is null) = C k (fp32 C [dv, dk]; unclamped),
  /// written to the same slots.
  template <KVCacheView C>
  static void fill_rows(TokenRows<float, StridedLayout, HostSpace> const& rows, C const& cache, Index b, Index h,
                        Index const* slots, Index from, Index count, float const* comoment, float* kt) {
    Index const dk = cache.keys.extents().dim, dv = cache.values.extents().dim, chunk = detail::moment_row_chunk(dk);
    for (Index t0 = 0; t0 < count; t0 += detail::moment_tile) {
      Index const nr = std::min(detail::moment_tile, count - t0);
      detail::load_rows(cache.keys, b, h, slots ? slots + t0 : nullptr, from + t0, nr, dk, kt);
      Eigen::Map<RowMatrix const> const km(kt, nr, dk);
      for (Index i = 0; i < nr; ++i) {
        float* u = rows.row(b, h, slots ? slots[t0 + i] : from + t0 + i);
        for (Index a0 = 0; a0 < dv; a0 += chunk) {  // u[a0:a1] = C[a0:a1, :] k
          Index const ac = std::min(chunk, dv - a0);
          Eigen::Map<Eigen::VectorXf>(u + a0, ac).noalias() =
              Eigen::Map<RowMatrix const>(comoment + a0 * dk, ac, dk) * km.row(i).transpose();
        }
      }
    }
  }

  /// Per worker for the fold: the evicted slots [tokens], block means (fp64) [dk + dv], centred tiles of K and V,
  /// the block co-moment [dv, dk], the 16-bit state's copy and Chan's scratch [dk], all fp32 but the means.
  static std::size_t fold_bytes(KVExtents const& keys, Index dv) {
    constexpr Index t = detail::moment_tile;
    Index const dk = keys.dim;
    return bytes_sum(workspace_round(bytes_product(keys.tokens, sizeof(Index))),
                     workspace_round(bytes_product(dk + dv, sizeof(double))),
                     workspace_round(bytes_product(2 * (dk + dv), sizeof(float))),
                     workspace_round(bytes_product(t, dk, sizeof(float))),
                     workspace_round(bytes_product(t, dv, sizeof(float))),
                     workspace_round(bytes_product(dv, dk, sizeof(float))),
                     workspace_round(bytes_product(detail::moment_copy_floats<T>(dk, dv), sizeof(float))),
                     workspace_round(bytes_product(dk, sizeof(float))));
  }
  static std::size_t on_evict_workspace_bytes(Cpu const& cpu, Scorer const& s, KVExtents const& keys) {
    return bytes_product(cpu.workers(), fold_bytes(keys, s.state.value_dim));
  }

  /// Folds the slots of [0, length) that `plan` does not keep into the head's moments: block mean and centred
  /// co-moment (one Eigen product per tile), then Chan's merge. Evicted rows with a NaN or Inf element are dropped
  /// instead (the moments describe the finite evicted rows; `count` counts them).
  template <KVCacheView C>
  static Status on_evict(Cpu const& cpu, Scorer const& s, C const& cache, KeepPlan<HostSpace> const& plan,
                         Workspace ws) {
    KVExtents const e = cache.keys.extents();
    Index const dk = e.dim, dv = cache.values.extents().dim;
    KVC_RETURN_IF_ERROR(s.check());
    KVC_RETURN_IF_ERROR(s.state.check(e.batch, e.heads, dk, dv));
    if (s.residuals.enabled())
      KVC_RETURN_IF_ERROR(check_residuals(s.residuals, e, dv));
    KVC_RETURN_IF_ERROR(validate_plan(plan, cache));
    std::size_t const per_worker = fold_bytes(e, dv);
    if (ws.bytes < on_evict_workspace_bytes(cpu, s, e))
      return {Errc::out_of_capacity, "kvc::on_evict(moment_kv): workspace smaller than on_evict_workspace_bytes()"};
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(bytes_product(cpu.workers(), per_worker)));
    detail::parallel_for(cpu, e.batch * e.heads, [&](Index item, Index worker) {
      Index const b = item / e.heads, h = item % e.heads;
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      Index* slots = carve.take<Index>(e.tokens);
      double* mean64 = carve.take<double>(dk + dv);
      float* mean = carve.take<float>(2 * (dk + dv));
      float* kt = carve.take<float>(detail::moment_tile * dk);
      float* vt = carve.take<float>(detail::moment_tile * dv);
      float* cb = carve.take<float>(dv * dk);
      float* copy = carve.take<float>(detail::moment_copy_floats<T>(dk, dv));
      float* scratch = carve.take<float>(dk);
      fold_head(s, cache, b, h, plan, slots, mean64, mean, kt, vt, cb, copy, scratch);
    });
    return {};
  }

  template <KVCacheView C>
  static void fold_head(Scorer const& s, C const& cache, Index b, Index h, KeepPlan<HostSpace> const& plan,
                        Index* slots, double* mean64, float* mean, float* kt, float* vt, float* cb, float* copy,
                        float* scratch) {
    MomentState<HostSpace, T> const& st = s.state;
    Index const dk = cache.keys.extents().dim, dv = cache.values.extents().dim, n = cache.length(b, h);
    Index const* keep = plan.indices(b, h);
    Index const kept = plan.kept(b, h);
    Index m = 0, evicted = 0;
    for (Index t = 0, j = 0; t < n; ++t) {  // the complement of the ascending kept list
      if (j < kept && keep[j] == t) {
        ++j;
      } else {
        ++evicted;
        // A row with a NaN or Inf element is dropped, not folded: it would make the head's moments (and so every
        // later score and corrected output of the head) NaN.
        if (detail::all_finite(cache.keys.row(b, h, t), dk, cache.keys.scale(b, h)) &&
            detail::all_finite(cache.values.row(b, h, t), dv, cache.values.scale(b, h)))
          slots[m++] = t;
      }
    }
    if (m == 0) {  // nothing to fold: the moments stay, and the u_j rows of the kept slots move with them
      if (evicted > 0 && s.residuals.enabled()) {
        Index& tracked = s.residuals.tracked[st.head(b, h)];
        Index below = 0;  // kept slots inside the valid prefix [0, tracked): they become [0, below)
        while (below < kept && keep[below] < tracked)
          ++below;
        tracked = below;
      }
      return;
    }
    // Block means in fp64 (a long prefill sums tens of thousands of rows), then the centred co-moment in fp32.
    auto const load_tile = [&](Index t0) {  // the evicted rows [t0, t0 + rows) into kt and vt, fp32
      Index const rows = std::min(detail::moment_tile, m - t0);
      detail::load_rows(cache.keys, b, h, slots + t0, 0, rows, dk, kt);
      detail::load_rows(cache.values, b, h, slots + t0, 0, rows, dv, vt);
      return rows;
    };
    std::fill(mean64, mean64 + dk + dv, 0.0);
    for (Index t0 = 0; t0 < m; t0 += detail::moment_tile) {
      Index const rows = load_tile(t0);
      for (Index i = 0; i < rows; ++i) {
        for (Index c = 0; c < dk; ++c)
          mean64[c] += kt[i * dk + c];
        for (Index a = 0; a < dv; ++a)
          mean64[dk + a] += vt[i * dv + a];
      }
    }
    float* kmean = mean;
    float* vmean = mean + dk;
    for (Index c = 0; c < dk + dv; ++c)
      mean[c] = static_cast<float>(mean64[c] / static_cast<double>(m));
    Eigen::Map<RowMatrix> cbm(cb, dv, dk);
    cbm.setZero();
    for (Index t0 = 0; t0 < m; t0 += detail::moment_tile) {
      Index const rows = load_tile(t0);
      for (Index i = 0; i < rows; ++i) {
        for (Index c = 0; c < dk; ++c)
          kt[i * dk + c] -= kmean[c];
        for (Index a = 0; a < dv; ++a)
          vt[i * dv + a] -= vmean[a];
      }
      Eigen::Map<RowMatrix const> const km(kt, rows, dk), vm(vt, rows, dv);
      Index const chunk = detail::moment_row_chunk(rows);
      for (Index a0 = 0; a0 < dv; a0 += chunk) {  // C_B[a0:a1, :] += V_c[:, a0:a1]ᵀ K_c
        Index const ac = std::min(chunk, dv - a0);
        cbm.middleRows(a0, ac).noalias() += vm.middleCols(a0, ac).transpose() * km;
      }
    }
    Index& count = st.count[st.head(b, h)];
    detail::MomentsF32<T> const cur = detail::load_moments(st, b, h, copy);
    float* old_kmean = mean + dk + dv;  // the means before the merge (the u_j update's k̄_a, v̄_a)
    float* old_vmean = old_kmean + dk;
    std::copy_n(cur.key_mean, dk, old_kmean);
    std::copy_n(cur.value_mean, dv, old_vmean);
    Index const n_a = count;
    detail::merge_moments<float>(count, cur.key_mean, cur.value_mean, cur.comoment, m, kmean, vmean, cb, dk, dv,
                                 scratch);
    detail::store_moments(st, b, h, cur);
    count += m;
    if (s.residuals.enabled())
      update_rows(s, cache, b, h, plan, n_a, m, kmean, vmean, old_kmean, old_vmean, cur.comoment, kt);
  }

  /// Keeps the kept slots' u_j rows equal to C' k_j after a merge (C' = `comoment`, fp32): Chan's rank-1 term for a
  /// single eviction onto valid rows (u_j += (n_a / (n_a + 1)) (v* − v̄_a) ((k* − k̄_a)ᵀ k_j), O(d) per row), else a
  /// full recompute (a block eviction, rows not all valid, or `refresh` incremental updates since the last one).
  template <KVCacheView C>
  static void update_rows(Scorer const& s, C const& cache, Index b, Index h, KeepPlan<HostSpace> const& plan, Index n_a,
                          Index m, float const* k_star, float const* v_star, float const* old_kmean,
                          float const* old_vmean, float const* comoment, float* kt) {
    Index const dk = cache.keys.extents().dim, dv = cache.values.extents().dim, n = cache.length(b, h);
    Index const head = s.state.head(b, h), kept = plan.kept(b, h);
    Index const* keep = plan.indices(b, h);
    Index& tracked = s.residuals.tracked[head];
    Index& age = s.residuals.age[head];
    if (m == 1 && tracked == n && age + 1 < s.residuals.refresh) {
      float const w = static_cast<float>(n_a) / static_cast<float>(n_a + 1);
      for (Index j = 0; j < kept; ++j) {
        auto const* k = cache.keys.row(b, h, keep[j]);
        auto const k_scale = cache.keys.scale(b, h);
        float dot = 0.0f;  // (k* − k̄_a)ᵀ k_j
        for (Index c = 0; c < dk; ++c)
          dot += (k_star[c] - old_kmean[c]) * load(k[c], k_scale);
        float* u = s.residuals.rows.row(b, h, keep[j]);
        float const coef = w * dot;
        for (Index a = 0; a < dv; ++a)
          u[a] += coef * (v_star[a] - old_vmean[a]);
      }
      ++age;
    } else {
      fill_rows(s.residuals.rows, cache, b, h, keep, 0, kept, comoment, kt);
      age = 0;
    }
    tracked = kept;  // compaction moves the kept rows to [0, kept) with the cache
  }
};

}  // namespace kvc
