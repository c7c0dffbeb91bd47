// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/uncomp.hpp: CPU kernels of UNCompScorer (score, update, on_evict) over the shared
// window-attention kernel (ColumnSums::per_window_row) and SnapKV's pooling.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/window_attention.hpp>
#include <kvc/scorers/uncomp.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace kvc {

template <>
struct Kernel<UNCompScorer<HostSpace>, Cpu> {
  using Scorer = UNCompScorer<HostSpace>;

  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, Scorer const&, KVExtents const& keys, Obs const&) {
    return bytes_product(cpu.workers(), workspace_round(bytes_product(keys.tokens, sizeof(float))));
  }

  /// s[j] = pool(sum_i A[i][j]) over the prefix, window slots above it (see scorers/uncomp.hpp).
  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, Scorer const& s, C const& cache, Obs const& obs, ScoreSpan<HostSpace> out,
                    Workspace ws) {
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(s.check_state(e));
    std::size_t const per_worker = workspace_round(bytes_product(e.tokens, sizeof(float)));
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, s, e, obs)));
    if (base == nullptr && per_worker > 0)
      return {Errc::out_of_capacity, "kvc::score(uncomp): workspace smaller than score_workspace_bytes()"};
    Index const w = s.window_size;
    return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index worker) {
      float* sum =
          WorkspaceCarver({base + static_cast<std::size_t>(worker) * per_worker, per_worker}).take<float>(e.tokens);
      Index const m = n - std::min(w, n);
      Index const tracked = std::clamp<Index>(s.state.tracked[b * e.heads + h], 0, n);
      for (Index j = 0; j < m; ++j) {
        float acc = 0.0f;
        if (j < tracked) {
          float const* a = s.state.window_rows.row(b, h, j);
          for (Index i = 0; i < w; ++i)  // oldest row first: the authors' sum order
            acc += a[i];
        }
        sum[j] = acc;
      }
      detail::pool1d(sum, m, s.kernel_size, s.pooling, score);
      detail::protect_tail(score, m, n);
    });
  }

  /// Per worker: the window attention's scratch for g * min(R, w) rows and their column sums [min(R, w), tokens].
  template <class Obs>
  static std::size_t update_workspace_bytes(Cpu const& cpu, Scorer const& s, KVExtents const& keys, Obs const& obs) {
    if constexpr (HasWindowQueries<Obs>)
      return bytes_product(cpu.workers(), worker_bytes(s, keys, obs.window_queries));
    else
      return 0;
  }

  /// Shifts every tracked slot's rows by the new rows, zeroes the slots appended since the last update, and writes
  /// the new rows' group-summed attention over the current cache (see scorers/uncomp.hpp).
  template <KVCacheView C, class Obs>
  static Status update(Cpu const& cpu, Scorer const& s, C const& cache, Obs const& obs, Workspace ws) {
    static_assert(HasWindowQueries<Obs>,
                  "kvc::update(uncomp): pass the new queries (kvc::observe(kvc::WindowQueries{...}))");
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(s.check_state(e));
    KVC_RETURN_IF_ERROR(detail::check_lengths(cache.lengths, e.batch, e.heads, e.tokens,
                                              "kvc::update: every valid length must be in [0, tokens]"));
    auto const& wq = obs.window_queries;
    Index const r = wq.window(), w = s.window_size, fresh = std::min(r, w), first = r - fresh;
    KVC_RETURN_IF_ERROR(detail::check_window_queries(
        wq, cache, fresh > 0 ? fresh : 1,
        "kvc::update(uncomp): window queries must be [batch, Hq, >= 1, d_k] with Hq a multiple of Hkv"));
    std::size_t const per_worker = worker_bytes(s, e, wq);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(bytes_product(cpu.workers(), per_worker)));
    if (base == nullptr)
      return {Errc::out_of_capacity, "kvc::update(uncomp): workspace smaller than update_workspace_bytes()"};
    Index const g = wq.rows.extents().heads / e.heads;
    std::size_t const attn = detail::window_attention_bytes(g * fresh, e.dim);
    float const scale = 1.0f / std::sqrt(static_cast<float>(e.dim));
    detail::parallel_for(cpu, e.batch * e.heads, [&](Index item, Index worker) {
      Index const b = item / e.heads, h = item % e.heads, n = cache.length(b, h);
      std::byte* mine = base + static_cast<std::size_t>(worker) * per_worker;
      float* colsum = WorkspaceCarver({mine + attn, per_worker - attn}).take<float>(fresh * e.tokens);
      Index& tracked = s.state.tracked[b * e.heads + h];
      tracked = std::clamp<Index>(tracked, 0, n);
      for (Index j = 0; j < n; ++j) {  // old rows move toward the front; new slots read 0 in them
        float* a = s.state.window_rows.row(b, h, j);
        if (j < tracked)
          std::copy(a + fresh, a + w, a);
        std::fill(a + (j < tracked ? w - fresh : 0), a + w, 0.0f);
      }
      tracked = n;
      detail::window_attention_columns(wq, cache, b, h, first, r, scale, colsum, e.tokens, mine, false,
                                       detail::ColumnSums::per_window_row);
      for (Index i = 0; i < fresh; ++i)
        for (Index j = 0; j < n; ++j)
          s.state.window_rows.row(b, h, j)[w - fresh + i] = colsum[i * e.tokens + j];
    });
    return {};
  }

  /// The kept slots that were tracked stay tracked (plans are ascending: those below the old count).
  template <KVCacheView C>
  static Status on_evict(Cpu const&, Scorer const& s, C const&, KeepPlan<HostSpace> const& plan, Workspace) {
    if (s.state.tracked == nullptr)
      return {Errc::invalid_argument, "kvc::on_evict(uncomp): the state's `tracked` is null"};
    for (Index b = 0; b < plan.batch; ++b)
      for (Index h = 0; h < plan.heads; ++h) {
        Index const* kept = plan.indices(b, h);
        Index& tracked = s.state.tracked[b * plan.heads + h];
        tracked = static_cast<Index>(std::lower_bound(kept, kept + plan.kept(b, h), tracked) - kept);
      }
    return {};
  }

 private:
  template <class Q>
  static std::size_t worker_bytes(Scorer const& s, KVExtents const& keys, Q const& wq) {
    Index const g = keys.heads > 0 ? std::max<Index>(1, wq.rows.extents().heads / keys.heads) : 1;
    Index const fresh = std::max<Index>(1, std::min(wq.window(), s.window_size));
    return bytes_sum(detail::window_attention_bytes(g * fresh, keys.dim),
                     workspace_round(bytes_product(fresh, keys.tokens, sizeof(float))));
  }
};

}  // namespace kvc
