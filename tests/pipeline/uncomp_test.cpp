// SPDX-License-Identifier: Apache-2.0
// tests/pipeline/uncomp_test.cpp: UNComp through the drivers an engine calls: the prefill (update, compress with
// UNCompSelector, on_evict, compact) and kvc::decode_step with interval 1 (one eviction per step per head over its
// budget), on a dense cache and on a ragged store sized by kvc::allocate (each head holds exactly its budget).
// The scorer's own reference checks (the spec's float64 recursion) are in tests/scorers/uncomp_test.cpp; here the
// drivers must reproduce the manual loop exactly.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/uncomp.hpp>
#include <kvc/backend/cpu/selectors/uncomp.hpp>
#include <kvc/pipeline/decode.hpp>
#include <kvc/store/ragged.hpp>

#include "common/ragged_store.hpp"
#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <vector>

namespace {

using kvc::Index;

/// UNComp state sized for `tokens` slots per head.
struct OwnedState {
  std::vector<float> rows;
  std::vector<Index> tracked;
  kvc::UNCompState<> view;
  OwnedState(Index batch, Index heads, Index tokens, Index w)
      : rows(static_cast<std::size_t>(batch * heads * tokens * w)), tracked(static_cast<std::size_t>(batch * heads)) {
    view = {{rows.data(), kvc::uncomp_window_layout({batch, heads, tokens, 1}, w)}, tracked.data()};
  }
};

/// Prefill of one layer: the last w prompt queries update the state, then select, on_evict, compact.
template <class Cache>
void prefill(kvc::UNCompScorer<> const& s, kvc::UNCompSelector<> const& sel, Cache const& cache,
             kvc::WindowQueries<float> const& wq) {
  kvc::KVExtents const e = cache.keys.extents();
  auto const obs = kvc::observe(wq);
  kvc::test::OwnedWorkspace wu(kvc::update_workspace_bytes(kvc::Cpu{}, s, e, obs));
  REQUIRE(kvc::update(kvc::Cpu{}, s, cache, obs, wu.get()).ok());
  kvc::Press const press{s, sel};
  kvc::test::OwnedPlan plan(e.batch, e.heads, e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
  REQUIRE(kvc::compress(kvc::Cpu{}, press, cache, plan.plan, ws.get()).ok());
  REQUIRE(kvc::on_evict(kvc::Cpu{}, s, cache, plan.plan, {}).ok());
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache, s.state.window_rows).ok());
}

}  // namespace

TEST_CASE("uncomp: decode_step on a ragged store sized by kvc::allocate keeps the dense cache's tokens") {
  Index const hkv = 2, g = 2, hq = hkv * g, d = 16, w = 4, prompt = 40, total = 64, reserve = 1;
  kvc::KVExtents const all{1, hkv, total, d};
  auto src = kvc::tools::HostCache<float>::random(all, 81);
  src.track(total);
  auto const qsrc = kvc::tools::random_values<float>(hq * total * d, 82, 1.5f);
  kvc::test::OwnedRope rope(kvc::RopeSpec{}, d, total + 1);
  std::vector<Index> const budgets{10, 23};
  kvc::UNCompSelector const sel{kvc::HeadBudgets{budgets.data(), hkv}, 0, w};

  // The prompt's last w queries (pre-RoPE, rotated at their positions by the table).
  std::vector<float> pq(static_cast<std::size_t>(hq * w * d));
  std::vector<Index> ppos(static_cast<std::size_t>(w));
  for (Index q = 0; q < hq; ++q)
    for (Index i = 0; i < w; ++i)
      std::copy_n(qsrc.data() + (q * total + prompt - w + i) * d, d, pq.data() + (q * w + i) * d);
  for (Index i = 0; i < w; ++i)
    ppos[static_cast<std::size_t>(i)] = prompt - w + i;
  kvc::WindowQueries<float> const wq{{pq.data(), kvc::bhtd_layout({1, hq, w, d})}, rope.table, ppos.data()};

  // Dense: the whole capacity. Ragged: the prompt, compressed in place, then re-laid out to exactly the budgets.
  kvc::tools::HostCache<float> dense({1, hkv, total, d});
  dense.track(0);
  REQUIRE(kvc::append(kvc::Cpu{}, dense.view(), src.view(), 0, prompt).ok());
  std::vector<Index> const prompt_counts(hkv, prompt);
  kvc::tools::HostRaggedStore<float> store(1, hkv, d, d, prompt_counts.data(), 0);
  REQUIRE(kvc::append(kvc::Cpu{}, store.view(), src.view(), 0, prompt).ok());

  OwnedState sd(1, hkv, total, w), sr(1, hkv, total, w);
  kvc::UNCompScorer<> const dense_scorer{sd.view, w}, ragged_scorer{sr.view, w};
  prefill(dense_scorer, sel, dense.view(), wq);
  prefill(ragged_scorer, sel, store.view(), wq);
  // kvc::allocate alone gives the totals an engine sizes its store with.
  std::vector<Index> totals(hkv);
  std::vector<Index> lengths(hkv, prompt);
  kvc::ScoreSpan<> const shape{nullptr, 1, hkv, prompt, kvc::head_lengths(lengths.data(), hkv)};
  REQUIRE(kvc::allocate(kvc::Cpu{}, sel, shape, totals.data(), {}).ok());
  CHECK(totals == budgets);
  CHECK(store.lengths == totals);
  store = kvc::tools::relayout(store, reserve);
  CHECK(kvc::store_report(store.view()).held_bytes ==
        (budgets[0] + budgets[1] + hkv * reserve) * kvc::store_report(store.view()).row_bytes);

  kvc::DecodeSchedule sch;
  sch.compression_interval = 1;
  sch.hidden_states_buffer_size = 1;
  std::vector<float> qd(static_cast<std::size_t>(hq * d)), qr(qd.size());
  std::vector<Index> posd(1), posr(1);
  kvc::QueryBuffer<float> bd{qd.data(), posd.data(), 1, hq, 1, d}, br{qr.data(), posr.data(), 1, hq, 1, d};
  kvc::DecodeCounter cd, cr;
  for (Index t = prompt; t < total; ++t) {
    REQUIRE(kvc::append(kvc::Cpu{}, dense.view(), src.view(), t, 1).ok());
    REQUIRE(kvc::append(kvc::Cpu{}, store.view(), src.view(), t, 1).ok());
    for (auto* buf : {&bd, &br}) {
      for (Index q = 0; q < hq; ++q)
        std::copy_n(qsrc.data() + (q * total + t) * d, d, buf->row(0, q, buf->count));
      buf->positions[buf->count] = t;
      REQUIRE(buf->push(1).ok());
    }
    kvc::test::OwnedWorkspace wd(kvc::decode_workspace_bytes(kvc::Cpu{}, dense_scorer, sel, sch, dense.ext, bd));
    kvc::Status const st =
        kvc::decode_step(kvc::Cpu{}, dense_scorer, sel, sch, dense.view(), bd, cd, rope.table, wd.get());
    INFO(st.message());
    REQUIRE(st.ok());
    kvc::test::OwnedWorkspace wr(
        kvc::decode_workspace_bytes(kvc::Cpu{}, ragged_scorer, sel, sch, store.view().keys.extents(), br));
    REQUIRE(kvc::decode_step(kvc::Cpu{}, ragged_scorer, sel, sch, store.view(), br, cr, rope.table, wr.get()).ok());
    REQUIRE(dense.lengths == budgets);  // one eviction per step per head: the budgets hold
    REQUIRE(store.lengths == budgets);
    for (Index h = 0; h < hkv; ++h) {
      auto const kept = dense.head_positions(0, h);
      for (Index j = 0; j < budgets[static_cast<std::size_t>(h)]; ++j)
        REQUIRE(store.view().position(0, h, j) == kept[static_cast<std::size_t>(j)]);
      for (Index j = 1; j < static_cast<Index>(kept.size()); ++j)  // position order (spec §7.18)
        REQUIRE(kept[static_cast<std::size_t>(j - 1)] < kept[static_cast<std::size_t>(j)]);
      REQUIRE(kept.back() == t);  // the newest token is in the window
    }
    CHECK(sd.rows == sr.rows);
  }
  CHECK(cd.compressions == total - prompt);
}
