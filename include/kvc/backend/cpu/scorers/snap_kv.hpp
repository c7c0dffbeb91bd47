// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/snap_kv.hpp: CPU kernel of SnapKVScorer over the shared window attention
// (detail/window_attention.hpp).
#pragma once

#include <kvc/backend/cpu/detail/for_each_head.hpp>
#include <kvc/backend/cpu/detail/window_attention.hpp>
#include <kvc/scorers/snap_kv.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>

namespace kvc {

template <>
struct Kernel<SnapKVScorer, Cpu> {
  /// Per worker: the window attention's scratch and its column sums [g, tokens].
  static std::size_t worker_bytes(SnapKVScorer const& s, KVExtents const& keys, Index query_heads) {
    Index const g = keys.heads > 0 ? std::max<Index>(1, query_heads / keys.heads) : 1;
    Index rows = 0;  // g * w query rows; w < 1 is rejected by run()
    if (__builtin_mul_overflow(g, std::max<Index>(s.window_size, 0), &rows))
      return saturated_bytes;
    return bytes_sum(detail::window_attention_bytes(rows, keys.dim),
                     workspace_round(bytes_product(g, keys.tokens, sizeof(float))));
  }
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const& cpu, SnapKVScorer const& s, KVExtents const& keys, Obs const& obs) {
    Index const query_heads = window_query_heads(obs, keys.heads);
    return bytes_product(cpu.workers(), worker_bytes(s, keys, query_heads));
  }

  template <KVCacheView C, class Obs>
  static Status run(Cpu const& cpu, SnapKVScorer const& s, C const& cache, Obs const& obs, ScoreSpan<HostSpace> out,
                    Workspace ws) {
    KVC_RETURN_IF_ERROR(s.check());
    auto const& wq = obs.window_queries;
    KVExtents const e = cache.keys.extents();  // lengths are checked by for_each_head (context_end clamps them)
    KVC_RETURN_IF_ERROR(detail::check_window_queries(
        wq, cache, s.window_size,
        "kvc::score(snap_kv): window queries must be [batch, Hq, >= window_size, d_k] with Hq a multiple of Hkv"));
    Index const hq = wq.rows.extents().heads, g = hq / e.heads, first = wq.window() - s.window_size;
    if (s.gqa == GqaReduce::per_query_head && g != 1)
      return {Errc::invalid_argument,
              "kvc::score(snap_kv): gqa=per_query_head (the authors' expanded storage) needs one KV head per query "
              "head; expand the cache or use gqa=mean|max|sum"};
    std::size_t const per_worker = worker_bytes(s, e, hq);
    auto* base = WorkspaceCarver(ws).take<std::byte>(static_cast<Index>(workspace_bytes(cpu, s, e, obs)));
    if (base == nullptr)
      return {Errc::out_of_capacity, "kvc::score(snap_kv): workspace smaller than score_workspace_bytes()"};
    float const scale = 1.0f / std::sqrt(static_cast<float>(e.dim));

    return detail::for_each_head(cpu, out, [&](Index b, Index h, Index n, float* score, Index worker) {
      std::byte* mine = base + static_cast<std::size_t>(worker) * per_worker;
      WorkspaceCarver carve({mine + detail::window_attention_bytes(g * s.window_size, e.dim),
                             per_worker - detail::window_attention_bytes(g * s.window_size, e.dim)});
      float* colsum = carve.take<float>(g * e.tokens);
      detail::window_attention_columns(wq, cache, b, h, first, scale, colsum, e.tokens, mine);
      Index const end = wq.positions ? 0 : context_end(cache, b);
      Index const m = slots_before(cache, b, h, detail::window_query_position(wq, b, end, first));
      for (Index j = 0; j < m; ++j)  // the formula both backends share (scorers/snap_kv.hpp)
        score[j] = snap_kv_score(s, g, m, j, [&](Index q, Index t) { return colsum[q * e.tokens + t]; });
      detail::protect_tail(score, m, n);
    });
  }
};

}  // namespace kvc
