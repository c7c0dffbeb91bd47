// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/h2o.hpp: CPU kernels of H2OScorer (score, update, on_evict) and ObservedAttentionScorer,
// over the shared window-attention kernel in tiles of query rows.
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/window_attention.hpp>
#include <kvc/scorers/h2o.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace kvc {

namespace detail {

/// Per worker scratch of tiled window attention: one tile's window-attention scratch and column sums [g, tokens].
inline std::size_t tiled_columns_bytes(Index g, Index tile, KVExtents const& keys) {
  Index rows = 0;
  if (__builtin_mul_overflow(g, tile, &rows))
    return saturated_bytes;
  return bytes_sum(window_attention_bytes(rows, keys.dim),
                   workspace_round(bytes_product(g, keys.tokens, sizeof(float))));
}

/// Column sums of window rows [0, w) for KV head (b, h), `tile` rows per pass (so the scratch holds one tile):
/// colsum [g, tokens] as in window_attention_columns. Returns colsum.
template <Element T, KVCacheView C>
float* tiled_columns(WindowQueries<T, HostSpace> const& wq, C const& cache, Index b, Index h, Index tile, float scale,
                     std::byte* scratch) {
  KVExtents const e = cache.keys.extents();
  Index const g = wq.rows.extents().heads / e.heads, w = wq.window(), rows = std::min(tile, w);
  std::size_t const attn = window_attention_bytes(g * rows, e.dim);
  float* colsum = WorkspaceCarver({scratch + attn, workspace_round(bytes_product(g, e.tokens, sizeof(float)))})
                      .take<float>(g * e.tokens);
  for (Index lq = 0; lq < g && w == 0; ++lq)
    std::fill(colsum + lq * e.tokens, colsum + lq * e.tokens + cache.length(b, h), 0.0f);
  for (Index r0 = 0; r0 < w; r0 += tile)
    window_attention_columns(wq, cache, b, h, r0, std::min(w, r0 + tile), scale, colsum, e.tokens, scratch, r0 > 0);
  return colsum;
}

}  // namespace detail

template <>
struct Kernel<H2OScorer<HostSpace>, Cpu> {
  using Scorer = H2OScorer<HostSpace>;

  static Status check_state(Scorer const& s, KVExtents const& e) {
    KVC_RETURN_IF_ERROR(s.check());
    auto const& a = s.state.accumulated;
    if (a.data == nullptr || s.state.tracked == nullptr || a.batch != e.batch || a.heads != e.heads ||
        a.tokens < e.tokens)
      return {Errc::invalid_argument,
              "h2o: the state needs `accumulated` [batch, KV heads, >= tokens] and `tracked` [batch, KV heads]"};
    return {};
  }

  template <class Obs>
  static std::size_t workspace_bytes(Cpu const&, Scorer const&, KVExtents const&, Obs const&) {
    return 0;
  }

  /// s[j] = acc[j] for tracked slots, 0 for slots appended since the last update.
  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, Scorer const& s, C const& cache, Obs const&, ScoreSpan<HostSpace> out, Workspace) {
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(check_state(s, e));
    return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index) {
      Index const tracked = std::clamp<Index>(s.state.tracked[b * e.heads + h], 0, n);
      std::copy_n(s.state.accumulated.row(b, h), tracked, score);
      std::fill(score + tracked, score + n, 0.0f);
    });
  }

  /// Per worker: the tiled window attention's scratch (none when the engine passes column sums).
  template <class Obs>
  static std::size_t update_workspace_bytes(Cpu const& cpu, Scorer const& s, KVExtents const& keys, Obs const& obs) {
    if constexpr (HasWindowQueries<Obs> && !HasAttention<Obs>) {
      Index const g = std::max<Index>(1, window_query_heads(obs, keys.heads) / std::max<Index>(keys.heads, 1));
      return bytes_sum(bytes_product(cpu.workers(), detail::tiled_columns_bytes(g, s.query_tile, keys)),
                       workspace_slack);
    } else {
      return 0;
    }
  }

  /// Adds the attention the observed queries (or the engine's column sums) paid every slot to its accumulator,
  /// after zeroing the slots appended since the last update; then every valid slot is tracked.
  template <KVCacheView C, class Obs>
  static Status update(Cpu const& cpu, Scorer const& s, C const& cache, Obs const& obs, Workspace ws) {
    static_assert(HasWindowQueries<Obs> || HasAttention<Obs>,
                  "kvc::update(h2o): pass the new queries (kvc::observe(kvc::WindowQueries{...})) or the engine's "
                  "attention column sums (Observations::attention)");
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(check_state(s, e));
    KVC_RETURN_IF_ERROR(detail::check_lengths(cache.lengths, e.batch, e.heads, e.tokens,
                                              "kvc::update: every valid length must be in [0, tokens]"));
    auto start = [&](Index b, Index h) {  // zero the untracked slots; returns the head's accumulator row
      Index const n = cache.length(b, h);
      Index const tracked = std::clamp<Index>(s.state.tracked[b * e.heads + h], 0, n);
      float* acc = s.state.accumulated.row(b, h);
      std::fill(acc + tracked, acc + n, 0.0f);
      s.state.tracked[b * e.heads + h] = n;
      return acc;
    };
    if constexpr (HasAttention<Obs>) {
      auto const& at = obs.attention;
      if (at.data == nullptr || at.batch != e.batch || at.heads < 1 || at.heads % e.heads != 0 || at.tokens < e.tokens)
        return {Errc::invalid_argument,
                "kvc::update(h2o): attention column sums must be [batch, Hq, >= tokens] with Hq a multiple of Hkv"};
      Index const g = at.heads / e.heads;
      for (Index b = 0; b < e.batch; ++b)
        for (Index h = 0; h < e.heads; ++h) {
          Index const n = cache.length(b, h);
          float* acc = start(b, h);
          float const* col = at.data + (b * at.heads + h * g) * at.tokens;
          for (Index j = 0; j < n; ++j)
            acc[j] = h2o_accumulate(acc[j], g, [&](Index lq) { return col[lq * at.tokens + j]; });
        }
      return {};
    } else {
      auto const& wq = obs.window_queries;
      KVC_RETURN_IF_ERROR(detail::check_window_queries(
          wq, cache, wq.window() > 0 ? wq.window() : 1,
          "kvc::update(h2o): window queries must be [batch, Hq, >= 1, d_k] with Hq a multiple of Hkv"));
      Index const g = wq.rows.extents().heads / e.heads;
      std::size_t const per_worker = detail::tiled_columns_bytes(g, s.query_tile, e);
      auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(bytes_product(cpu.workers(), per_worker)));
      if (base == nullptr)
        return {Errc::out_of_capacity, "kvc::update(h2o): workspace smaller than update_workspace_bytes()"};
      float const scale = 1.0f / std::sqrt(static_cast<float>(e.dim));
      detail::parallel_for(cpu, e.batch * e.heads, [&](Index item, Index worker) {
        Index const b = item / e.heads, h = item % e.heads, n = cache.length(b, h);
        float* acc = start(b, h);
        float const* colsum = detail::tiled_columns(wq, cache, b, h, s.query_tile, scale,
                                                    base + static_cast<std::size_t>(worker) * per_worker);
        for (Index j = 0; j < n; ++j)
          acc[j] = h2o_accumulate(acc[j], g, [&](Index lq) { return colsum[lq * e.tokens + j]; });
      });
      return {};
    }
  }

  /// Compaction keeps plan.count slots per head, and their accumulators travel with them (kvc::compact's extra
  /// array), so exactly those stay tracked. `tracked` is [batch, heads] of the cache (check_state), so the plan must
  /// be too: a larger plan would write past it.
  template <KVCacheView C>
  static Status on_evict(Cpu const&, Scorer const& s, C const& cache, KeepPlan<HostSpace> const& plan, Workspace) {
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(check_state(s, e));
    if (plan.batch != e.batch || plan.heads != e.heads || (plan.count == nullptr && e.batch * e.heads > 0))
      return {Errc::invalid_argument,
              "kvc::on_evict(h2o): `plan` must be [batch, heads] of the cache (the state's shape) with a `count`"};
    for (Index i = 0; i < e.batch * e.heads; ++i)
      s.state.tracked[i] = plan.count[i];
    return {};
  }
};

template <>
struct Kernel<ObservedAttentionScorer, Cpu> {
  static std::size_t worker_bytes(ObservedAttentionScorer const& s, KVExtents const& keys, Index query_heads,
                                  Index window) {
    Index const g = keys.heads > 0 ? std::max<Index>(1, query_heads / keys.heads) : 1;
    return bytes_sum(detail::tiled_columns_bytes(g, std::max<Index>(1, s.query_tile), keys),
                     workspace_round(bytes_product(window, sizeof(Index))));
  }
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, ObservedAttentionScorer const& s, KVExtents const& keys,
                                     Obs const& obs) {
    Index window = 0;
    if constexpr (HasWindowQueries<Obs>)
      window = obs.window_queries.window();
    return bytes_product(cpu.workers(), worker_bytes(s, keys, window_query_heads(obs, keys.heads), window));
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, ObservedAttentionScorer const& s, C const& cache, Obs const& obs,
                    ScoreSpan<HostSpace> out, Workspace ws) {
    KVC_RETURN_IF_ERROR(s.check());
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();
    Index const w = wq.window();
    KVC_RETURN_IF_ERROR(detail::check_window_queries(
        wq, cache, w > 0 ? w : 1,
        "kvc::score(h2o, reference=kvpress): window queries must be [batch, Hq, >= 1, d_k] (every prompt query) "
        "with Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads, g = hq / e.heads;
    std::size_t const per_worker = worker_bytes(s, e, hq, w);
    std::size_t const attn = detail::tiled_columns_bytes(g, s.query_tile, e);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, s, e, obs)));
    if (base == nullptr)
      return {Errc::out_of_capacity, "kvc::score(h2o): workspace smaller than score_workspace_bytes()"};
    float const scale = 1.0f / std::sqrt(static_cast<float>(e.dim));
    return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index worker) {
      std::byte* mine = base + static_cast<std::size_t>(worker) * per_worker;
      float const* colsum = detail::tiled_columns(wq, cache, b, h, s.query_tile, scale, mine);
      Index* q_pos = WorkspaceCarver({mine + attn, per_worker - attn}).take<Index>(w);
      Index const end = wq.positions ? 0 : context_end(cache, b);
      for (Index i = 0; i < w; ++i)
        q_pos[i] = detail::window_query_position(wq, b, end, i);
      std::sort(q_pos, q_pos + w);
      for (Index j = 0; j < n; ++j) {  // queries that see slot j: those at or after its position
        Index const seen = static_cast<Index>(q_pos + w - std::lower_bound(q_pos, q_pos + w, cache.position(b, h, j)));
        score[j] = observed_attention_score(g, seen, [&](Index lq) { return colsum[lq * e.tokens + j]; });
      }
    });
  }
};

}  // namespace kvc
