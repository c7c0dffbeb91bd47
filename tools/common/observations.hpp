// SPDX-License-Identifier: Apache-2.0
// tools/common/observations.hpp: the one place the tools (`kvc`, `kvc-eval`) turn observed query rows into what a
// scorer reads, as docs/integration.md tells engines to: window queries (SnapKV, TOVA, ObservedAttention), query
// statistics (ExpectedAttention) or a stateful scorer's state updated with the queries (H2O).
#pragma once

#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>

#include "common/policies.hpp"

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>

namespace kvc::tools {

/// Query rows a tool observed for one layer: [B, Hq, R, d] fp32, their absolute positions [B, R] (null: the
/// context's last R positions), the table that rotates them (empty: post-RoPE rows) and the RoPE it came from
/// (ExpectedAttention averages it over future positions past the table).
struct ObservedQueries {
  TokenRows<float const, StridedLayout> rows;
  Index const* positions = nullptr;
  RopeTable<> rope{};
  RopeSpec spec{};
  bool pre_rope = true;
};

/// Owned buffers the observations point into, alive while the callback runs.
struct ObservationStorage {
  std::vector<float> mean, covariance, rope, accumulated;
  std::vector<Index> tracked;
  std::vector<std::byte> workspace;
};

/// Calls fn(scorer, obs) with the observations scorer S reads, built from `q` over `cache` (a prefilled context):
///  - window queries: the rows as given (SnapKV, TOVA, ObservedAttention);
///  - query statistics: mean and covariance of the rows at positions >= n_sink, t0 = the next position (kvpress:
///    the number of rows), R̄ from a table over [0, t0 + n_future_positions);
///  - H2O: its accumulator over the cache's slots, updated with every row's attention; then no observations;
///  - otherwise: none.
/// Bad combinations (post-RoPE rows for ExpectedAttention) fail with exit code 3 naming `what`.
template <class S, class C, class Fn>
void with_observations(S const& scorer, C const& cache, ObservedQueries const& q, std::string const& what,
                       ObservationStorage& store, Fn&& fn) {
  KVExtents const e = cache.keys.extents();
  auto wq = [&] { return WindowQueries<float>{q.rows, q.rope, q.positions}; };
  if constexpr (has_need(S::needs, Needs::query_statistics)) {
    if (!q.pre_rope)
      fail(exit_invalid, what + ": policy " + std::string(S::name) +
                             " estimates future queries from PRE-RoPE samples: pass pre-RoPE queries (not "
                             "--param queries=post_rope)");
    KVExtents const qe = q.rows.extents();
    store.mean.assign(static_cast<std::size_t>(qe.batch * qe.heads * qe.dim), 0.0f);
    store.covariance.assign(static_cast<std::size_t>(qe.batch * qe.heads * qe.dim * qe.dim), 0.0f);
    store.workspace.resize(query_statistics_workspace_bytes(Cpu{}, qe));
    Index end = 0;
    for (Index b = 0; b < e.batch; ++b)
      end = std::max(end, context_end(cache, b));
    Index const t0 = scorer.reference == Reference::kvpress ? qe.tokens : end;
    std::vector<Index> positions;  // the rows' positions, [B, R]
    if (!q.positions) {
      for (Index b = 0; b < qe.batch; ++b)
        for (Index i = 0; i < qe.tokens; ++i)
          positions.push_back(context_end(cache, b) - qe.tokens + i);
    }
    Status st = query_statistics(Cpu{}, q.rows, q.positions ? q.positions : positions.data(),
                                 StatisticsRows{scorer.n_sink, 0, -1}, store.mean.data(),
                                 scorer.use_covariance ? store.covariance.data() : nullptr,
                                 {store.workspace.data(), store.workspace.size()});
    if (!st.ok())
      fail(exit_invalid, what + ": " + st.message());
    Index const positions_needed = t0 + scorer.n_future_positions;
    Index const rotated = q.spec.rotated(qe.dim);
    store.rope.resize(static_cast<std::size_t>(rope_table_floats(positions_needed, rotated)));
    RopeTable<> table;
    if (st = fill_rope_table(q.spec, qe.dim, positions_needed, store.rope.data(), table); !st.ok())
      fail(exit_invalid, what + ": --rope: " + st.message());
    QueryStatistics<> const stats{
        store.mean.data(), store.covariance.data(), qe.batch, qe.heads, qe.dim, table, nullptr, qe.tokens};
    fn(scorer, observe(stats));
  } else if constexpr (StatefulScorer<S>) {
    store.accumulated.assign(static_cast<std::size_t>(e.rows()), 0.0f);
    store.tracked.assign(static_cast<std::size_t>(e.batch * e.heads), 0);
    S live = scorer;
    live.state = {{store.accumulated.data(), e.batch, e.heads, e.tokens}, store.tracked.data()};
    auto const obs = observe(wq());
    store.workspace.resize(update_workspace_bytes(Cpu{}, live, e, obs));
    if (Status const st = update(Cpu{}, live, cache, obs, {store.workspace.data(), store.workspace.size()}); !st.ok())
      fail(exit_invalid, what + ": " + st.message());
    fn(live, NoObservations{});
  } else if constexpr (has_need(S::needs, Needs::window_queries)) {
    fn(scorer, observe(wq()));
  } else {
    fn(scorer, NoObservations{});
  }
}

}  // namespace kvc::tools
