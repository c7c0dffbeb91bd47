// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/rdkv.hpp: CPU kernels of RDKVTokenScorer (attn_linear over the shared window-attention
// kernel; derived over a per-row softmax loop of its own) and ThinKChannelScorer. Formulas: scorers/rdkv.hpp.
// One (sequence, KV head) per task with per-worker scratch, every sum in a fixed order: bit-identical scores for
// any thread count.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/rows.hpp>
#include <kvc/backend/cpu/detail/window_attention.hpp>
#include <kvc/core/norm_range.hpp>
#include <kvc/scorers/rdkv.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace kvc {

namespace detail {

/// kvc::reflect_avg_pooled_at of every slot of x[0, n), into out[0, n) (out != x).
inline void reflect_avg_pool(float const* x, Index n, Index k, float* out) noexcept {
  for (Index j = 0; j < n; ++j)
    out[j] = reflect_avg_pooled_at(n, k, j, [x](Index t) { return x[t]; });
}

/// n_j of the head's n slots (see scorers/rdkv.hpp): the window rows [first, w) whose position is >= pos(j). A row at
/// position p sees the slot prefix [0, m) with m = slots_before(p + 1), so each row adds 1 to a prefix: a difference
/// array (count[m - 1] += 1; `count` has n + 1 entries) and one suffix sum instead of n * W comparisons.
template <Element T, KVCacheView C>
void rows_seeing(WindowQueries<T, HostSpace> const& wq, C const& cache, Index b, Index h, Index n, Index first,
                 Index* count) noexcept {
  std::fill(count, count + n + 1, Index{0});
  Index const end = wq.positions ? 0 : context_end(cache, b);
  for (Index i = first; i < wq.window(); ++i) {
    Index const m = slots_before(cache, b, h, window_query_position(wq, b, end, i) + 1);
    if (m > 0)  // a row that sees nothing counts for no slot
      ++count[m - 1];
  }
  for (Index j = n - 2; j >= 0; --j)  // count[j] = rows whose visible prefix reaches slot j
    count[j] += count[j + 1];
}

/// One window query row of query head `q` (global index), widened to fp32 and rotated to its position when the
/// window queries carry a RopeTable (the rotation window_attention_columns applies), into `dst` [dim].
template <Element T>
void rotated_query(WindowQueries<T, HostSpace> const& wq, Index b, Index q, Index row, Index position,
                   float* dst) noexcept {
  KVExtents const e = wq.rows.extents();
  widen(wq.rows.row(b, q, row), dst, e.dim);
  if (!wq.rope.empty())
    wq.rope.rotate(dst, position);
}

}  // namespace detail

template <>
struct Kernel<RDKVTokenScorer, Cpu> {
  /// Per worker. attn_linear: the window attention's scratch for g * W rows, column sums [g, tokens] and the row
  /// counts [tokens + 1]. derived: one query row [d], probabilities [tokens], E[a²] sums [tokens], the counts.
  static std::size_t worker_bytes(RDKVTokenScorer const& s, KVExtents const& keys, Index query_heads) {
    Index const g = keys.heads > 0 ? std::max<Index>(1, query_heads / keys.heads) : 1;
    std::size_t const counts = workspace_round(bytes_product(keys.tokens + 1, sizeof(Index)));
    std::size_t const token_floats = workspace_round(bytes_product(keys.tokens, sizeof(float)));
    if (s.weight == RDKVTokenWeight::derived)
      return bytes_sum(workspace_round(bytes_product(keys.dim, sizeof(float))), token_floats, token_floats, counts);
    Index rows = 0;  // g * W query rows; W < 1 is rejected by run()
    if (__builtin_mul_overflow(g, std::max<Index>(s.window_size, 0), &rows))
      return saturated_bytes;
    return bytes_sum(detail::window_attention_bytes(rows, keys.dim),
                     workspace_round(bytes_product(g, keys.tokens, sizeof(float))), counts);
  }
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, RDKVTokenScorer const& s, KVExtents const& keys, Obs const& obs) {
    return bytes_product(cpu.workers(), worker_bytes(s, keys, window_query_heads(obs, keys.heads)));
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, RDKVTokenScorer const& s, C const& cache, Obs const& obs, ScoreSpan<HostSpace> out,
                    Workspace ws) {
    KVC_RETURN_IF_ERROR(s.check());
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();  // lengths are checked by for_each_head
    KVC_RETURN_IF_ERROR(detail::check_window_queries(
        wq, cache, s.window_size,
        "kvc::score(rdkv): window queries must be [batch, Hq, >= window_size, d_k] with Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads, g = hq / e.heads, first = wq.window() - s.window_size;
    std::size_t const per_worker = worker_bytes(s, e, hq);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, s, e, obs)));
    if (base == nullptr)
      return {Errc::out_of_capacity, "kvc::score(rdkv): workspace smaller than score_workspace_bytes()"};
    float const scale = 1.0f / std::sqrt(static_cast<float>(e.dim));
    Index const dv = cache.values.extents().dim;

    if (s.weight == RDKVTokenWeight::attn_linear) {
      std::size_t const attention = detail::window_attention_bytes(g * s.window_size, e.dim);
      return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index worker) {
        std::byte* mine = base + static_cast<std::size_t>(worker) * per_worker;
        WorkspaceCarver carve({mine + attention, per_worker - attention});
        float* colsum = carve.take<float>(g * e.tokens);
        Index* seen = carve.take<Index>(e.tokens + 1);
        detail::window_attention_columns(wq, cache, b, h, first, scale, colsum, e.tokens, mine);
        detail::rows_seeing(wq, cache, b, h, n, first, seen);
        for (Index j = 0; j < n; ++j) {  // the group's sum (query heads in order), then the authors' correct_norm
          float acc = colsum[j];
          for (Index q = 1; q < g; ++q)
            acc += colsum[q * e.tokens + j];
          colsum[j] = seen[j] > 0 ? acc / static_cast<float>(seen[j]) : 0.0f;
        }
        detail::reflect_avg_pool(colsum, n, s.kernel_size, score);
      });
    }

    // derived: a² needs each head's own probabilities, which the shared kernel only hands out summed (over the
    // window or over the group). An option, so a plain per-row pass: logits of the visible prefix, softmax, squares.
    return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index worker) {
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      float* qrow = carve.take<float>(e.dim);
      float* prob = carve.take<float>(e.tokens);
      float* acc = carve.take<float>(e.tokens);
      Index* seen = carve.take<Index>(e.tokens + 1);
      std::fill(acc, acc + n, 0.0f);
      Index const end = wq.positions ? 0 : context_end(cache, b);
      for (Index q = 0; q < g; ++q)
        for (Index i = first; i < wq.window(); ++i) {
          Index const p = detail::window_query_position(wq, b, end, i);
          Index const m = slots_before(cache, b, h, p + 1);  // the causally visible prefix
          if (m == 0)
            continue;  // the row sees nothing and contributes nothing (as in the shared kernel)
          detail::rotated_query(wq, b, h * g + q, i, p, qrow);
          for (Index c = 0; c < e.dim; ++c)
            qrow[c] *= scale;
          float peak = -std::numeric_limits<float>::infinity();
          for (Index j = 0; j < m; ++j) {  // a NaN or Inf logit (a non-finite key) gets probability 0
            float const x = detail::dot(cache.keys.row(b, h, j), qrow, e.dim, cache.keys.scale(b, h));
            prob[j] = detail::finite_logit(x);
            peak = std::max(peak, prob[j]);
          }
          if (peak == -std::numeric_limits<float>::infinity())
            continue;  // no finite logit: the row contributes nothing
          float total = 0.0f;
          for (Index j = 0; j < m; ++j) {
            prob[j] = std::exp(prob[j] - peak);
            total += prob[j];
          }
          float const inv = 1.0f / total;
          for (Index j = 0; j < m; ++j) {
            float const a = prob[j] * inv;
            acc[j] += a * a;
          }
        }
      detail::rows_seeing(wq, cache, b, h, n, first, seen);
      for (Index j = 0; j < n; ++j)
        acc[j] = seen[j] > 0 ? acc[j] / static_cast<float>(seen[j]) : 0.0f;
      detail::reflect_avg_pool(acc, n, s.kernel_size, score);
      for (Index j = 0; j < n; ++j) {  // times d_v · sigma_j² (population variance, two passes in fp64)
        auto const* v = cache.values.row(b, h, j);
        auto const v_scale = cache.values.scale(b, h);
        double mean = 0.0, var = 0.0;
        for (Index c = 0; c < dv; ++c)
          mean += static_cast<double>(load(v[c], v_scale));
        mean = dv > 0 ? mean / static_cast<double>(dv) : 0.0;
        for (Index c = 0; c < dv; ++c) {
          double const x = static_cast<double>(load(v[c], v_scale)) - mean;
          var += x * x;
        }
        score[j] = static_cast<float>(static_cast<double>(score[j]) * var);  // d_v · (var / d_v)
      }
    });
  }
};

template <>
struct Kernel<ThinKChannelScorer, Cpu> {
  /// Per worker: one query row [d] (fp32) and the two channel sums [d] (fp64).
  static std::size_t worker_bytes(KVExtents const& keys) {
    return bytes_sum(workspace_round(bytes_product(keys.dim, sizeof(float))),
                     workspace_round(bytes_product(keys.dim, sizeof(double))),
                     workspace_round(bytes_product(keys.dim, sizeof(double))));
  }
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, ThinKChannelScorer const&, KVExtents const& keys, Obs const&) {
    return bytes_product(cpu.workers(), worker_bytes(keys));
  }

  /// out[(b * heads + h) * d + c] = mean over the group's window rows of q_c² times mean over the head's valid
  /// tokens of k_c² (sums in fp64, in row and slot order).
  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, ThinKChannelScorer const& s, C const& cache, Obs const& obs, float* out,
                    Workspace ws) {
    KVC_RETURN_IF_ERROR(s.check());
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(detail::check_lengths(cache.lengths, e.batch, e.heads, e.tokens,
                                              "kvc::score_channels: every valid length must be in [0, tokens]"));
    KVC_RETURN_IF_ERROR(detail::check_window_queries(
        wq, cache, s.window_size,
        "kvc::score_channels(think): window queries must be [batch, Hq, >= window_size, d_k] with Hq a multiple "
        "of Hkv"));
    Index const hq = wq.rows.extents().heads, g = hq / e.heads, first = wq.window() - s.window_size, d = e.dim;
    std::size_t const per_worker = worker_bytes(e);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, s, e, obs)));
    if (base == nullptr && per_worker > 0)
      return {Errc::out_of_capacity, "kvc::score_channels: workspace smaller than channel_score_workspace_bytes()"};
    detail::parallel_for(cpu, e.batch * e.heads, [&](Index item, Index worker) {
      Index const b = item / e.heads, h = item % e.heads, n = cache.length(b, h);
      WorkspaceCarver carve({base + static_cast<std::size_t>(worker) * per_worker, per_worker});
      float* qrow = carve.take<float>(d);
      double* qsq = carve.take<double>(d);
      double* ksq = carve.take<double>(d);
      std::fill(qsq, qsq + d, 0.0);
      std::fill(ksq, ksq + d, 0.0);
      Index const end = wq.positions ? 0 : context_end(cache, b);
      for (Index q = 0; q < g; ++q)
        for (Index i = first; i < wq.window(); ++i) {
          detail::rotated_query(wq, b, h * g + q, i, detail::window_query_position(wq, b, end, i), qrow);
          for (Index c = 0; c < d; ++c)
            qsq[c] += static_cast<double>(qrow[c]) * static_cast<double>(qrow[c]);
        }
      Index finite = 0;  // a key with a NaN or Inf element is left out of the mean (it would poison every channel)
      for (Index j = 0; j < n; ++j) {
        auto const* k = cache.keys.row(b, h, j);
        auto const k_scale = cache.keys.scale(b, h);
        if (!detail::all_finite(k, d, k_scale))
          continue;
        ++finite;
        for (Index c = 0; c < d; ++c) {
          double const x = static_cast<double>(load(k[c], k_scale));
          ksq[c] += x * x;
        }
      }
      double const q_rows = static_cast<double>(g * s.window_size);
      double const k_rows = finite > 0 ? static_cast<double>(finite) : 1.0;  // an empty head: mean 0
      float* o = out + item * d;
      for (Index c = 0; c < d; ++c)
        o[c] = static_cast<float>(qsq[c] / q_rows * (ksq[c] / k_rows));
    });
    return {};
  }

  /// ThinK has one weight per channel, not per token: kvc::score cannot run it.
  template <KVCacheView C, class Obs>
  static Status run(Cpu const&, ThinKChannelScorer const&, C const&, Obs const&, ScoreSpan<HostSpace>, Workspace) {
    static_assert(sizeof(C) == 0,
                  "kvc::score: ThinKChannelScorer scores K channels, not tokens: call kvc::score_channels(backend, "
                  "scorer, cache, obs, out /*[batch, Hkv, d_k]*/, ws)");
    return {};
  }
};

}  // namespace kvc
