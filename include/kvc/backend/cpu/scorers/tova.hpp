// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/tova.hpp: CPU kernel of TOVAScorer over the shared window attention
// (detail/window_attention.hpp).
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/window_attention.hpp>
#include <kvc/scorers/tova.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace kvc {

template <>
struct Kernel<TOVAScorer, Cpu> {
  /// Per worker: the window attention's scratch for one query row per head, and column sums [g, tokens].
  static std::size_t worker_bytes(KVExtents const& keys, Index query_heads) {
    Index const g = keys.heads > 0 ? std::max<Index>(1, query_heads / keys.heads) : 1;
    return bytes_sum(detail::window_attention_bytes(g, keys.dim),
                     workspace_round(bytes_product(g, keys.tokens, sizeof(float))));
  }
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, TOVAScorer const&, KVExtents const& keys, Obs const& obs) {
    Index const query_heads = window_query_heads(obs, keys.heads);
    return bytes_product(cpu.workers(), worker_bytes(keys, query_heads));
  }

  /// One sequence per item: its score is the mean over every query head, so all its KV heads are needed at once.
  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, TOVAScorer const& s, C const& cache, Obs const& obs, ScoreSpan<HostSpace> out,
                    Workspace ws) {
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();
    KVC_RETURN_IF_ERROR(detail::check_lengths(cache.lengths, e.batch, e.heads, e.tokens,
                                              "kvc::score: every valid length must be in [0, tokens]"));
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 1; h < e.heads; ++h)
        if (cache.length(b, h) != cache.length(b, 0))
          return {Errc::invalid_argument,
                  "kvc::score(tova): every KV head of a sequence must hold the same slots (equal lengths)"};
    KVC_RETURN_IF_ERROR(detail::check_window_queries(
        wq, cache, 1, "kvc::score(tova): window queries must be [batch, Hq, >= 1, d_k] with Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads, g = hq / e.heads, last = wq.window() - 1;
    std::size_t const per_worker = worker_bytes(e, hq);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, s, e, obs)));
    if (base == nullptr)
      return {Errc::out_of_capacity, "kvc::score(tova): workspace smaller than score_workspace_bytes()"};
    float const scale = 1.0f / std::sqrt(static_cast<float>(e.dim));
    constexpr float neg_inf = -std::numeric_limits<float>::infinity();

    detail::parallel_for(cpu, e.batch, [&](Index b, Index worker) {
      std::byte* mine = base + static_cast<std::size_t>(worker) * per_worker;
      float* colsum = WorkspaceCarver({mine + detail::window_attention_bytes(g, e.dim),
                                       per_worker - detail::window_attention_bytes(g, e.dim)})
                          .take<float>(g * e.tokens);
      Index const n = e.heads > 0 ? cache.length(b, 0) : 0;
      float* score = out.row(b, 0);
      std::fill(score, score + n, 0.0f);
      for (Index h = 0; h < e.heads; ++h) {  // the KV heads' groups in order: query heads 0, 1, ..., Hq - 1
        detail::window_attention_columns(wq, cache, b, h, last, scale, colsum, e.tokens, mine);
        for (Index j = 0; j < n; ++j)
          score[j] = tova_add_group(score[j], g, [&](Index q) { return colsum[q * e.tokens + j]; });
      }
      for (Index j = 0; j < n; ++j)
        score[j] = tova_mean(score[j], hq);
      if (s.reference == Reference::kvpress) {
        Index const end = wq.positions ? 0 : context_end(cache, b);
        detail::protect_tail(score, slots_before(cache, b, 0, detail::window_query_position(wq, b, end, last)), n);
      }
      std::fill(score + n, score + e.tokens, neg_inf);
      for (Index h = 1; h < e.heads; ++h)
        std::copy_n(score, e.tokens, out.row(b, h));
    });
    return {};
  }
};

}  // namespace kvc
