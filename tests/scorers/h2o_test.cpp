// SPDX-License-Identifier: Apache-2.0
// tests/scorers/h2o_test.cpp mirrors include/kvc/scorers/h2o.hpp (CPU kernels in backend/cpu/scorers/h2o.hpp).
// Reference values: the worked example of shared/specs/original_baselines.md §1.10 (attention rows given there),
// closed forms for uniform attention (zero queries: row i pays 1/(i+1) to each slot it sees), and the §1.9
// properties. NumPy oracle vectors on random and real caches are compared in tests/reference/.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <string>
#include <vector>

namespace {

using Catch::Matchers::WithinAbs;
using kvc::Index;

/// One layer's H2O state, owned.
struct OwnedState {
  std::vector<float> acc;
  std::vector<Index> tracked;
  kvc::H2OState<> view;
  OwnedState(Index b, Index h, Index capacity)
      : acc(static_cast<std::size_t>(b * h * capacity), -5.0f), tracked(static_cast<std::size_t>(b * h), 0) {
    view = {{acc.data(), b, h, capacity}, tracked.data()};
  }
};

/// Adds column sums `cols` ([tokens] per head, slots as in the cache) of one step to the accumulator.
template <class Cache>
void update_with(kvc::H2OScorer<> const& s, Cache const& cache, std::vector<float> cols) {
  kvc::KVExtents const e = cache.keys.extents();
  cols.resize(static_cast<std::size_t>(e.tokens), 0.0f);
  auto const obs = kvc::observe(kvc::AttentionColumnSums<>{cols.data(), 1, 1, e.tokens, 1});
  REQUIRE(kvc::update(kvc::Cpu{}, s, cache, obs, {}).ok());
}

/// H2O's eviction: keep hh heavy hitters + `recent`, on_evict, then compact with the accumulator.
template <class Cache>
void evict(kvc::H2OScorer<> const& s, Cache const& cache, Index hh, Index recent) {
  kvc::KVExtents const e = cache.keys.extents();
  kvc::Press const press{s, kvc::TopKSelector{kvc::FixedBudget{hh + recent}, 0, recent}};
  kvc::test::OwnedPlan plan(e.batch, e.heads, e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
  REQUIRE(kvc::compress(kvc::Cpu{}, press, cache, plan.plan, ws.get()).ok());
  REQUIRE(kvc::on_evict(kvc::Cpu{}, s, cache, plan.plan, {}).ok());
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache, s.state.accumulated).ok());
}

}  // namespace

TEST_CASE("h2o: the worked example of original_baselines 1.10, prefill then two decode steps") {
  kvc::tools::HostCache<float> cache(kvc::KVExtents{1, 1, 8, 2});
  cache.track(6);
  OwnedState state(1, 1, 8);
  kvc::H2OScorer<> const s{state.view};
  update_with(s, cache.view(), {3.1f, 0.85f, 1.05f, 0.4f, 0.55f, 0.05f});  // column sums of the prompt's attention
  evict(s, cache.view(), 2, 2);
  CHECK(cache.head_positions(0, 0) == std::vector<Index>{0, 2, 4, 5});
  std::vector<float> const after_prefill{3.1f, 1.05f, 0.55f, 0.05f};
  CHECK(std::vector<float>(state.acc.begin(), state.acc.begin() + 4) == after_prefill);

  auto step = [&](Index position, std::vector<float> row) {  // append the token, its attention row, evict
    Index& n = cache.lengths[0];
    cache.positions[static_cast<std::size_t>(n)] = position;
    ++n;
    update_with(s, cache.view(), std::move(row));
    evict(s, cache.view(), 2, 2);
  };
  step(6, {0.3f, 0.05f, 0.05f, 0.5f, 0.1f});
  CHECK(cache.head_positions(0, 0) == std::vector<Index>{0, 2, 5, 6});  // token 4 (0.6) evicted
  std::vector<double> const s6{3.4, 1.1, 0.55, 0.1};
  for (std::size_t i = 0; i < 4; ++i)
    CHECK_THAT(state.acc[i], WithinAbs(s6[i], 1e-6));
  step(7, {0.2f, 0.04f, 0.61f, 0.1f, 0.05f});
  CHECK(cache.head_positions(0, 0) == std::vector<Index>{0, 5, 6, 7});  // token 2 (1.14 < 1.16) evicted
  std::vector<double> const s7{3.6, 1.16, 0.2, 0.05};
  for (std::size_t i = 0; i < 4; ++i)
    CHECK_THAT(state.acc[i], WithinAbs(s7[i], 1e-6));
  CHECK(state.tracked[0] == 4);
}

namespace {

/// Uniform attention: zero queries see each visible slot with probability 1 / (visible count).
struct ZeroQueries {
  kvc::test::OwnedQueries<float> q;
  explicit ZeroQueries(kvc::KVExtents e) : q(e) {}
  kvc::WindowQueries<float> view() const { return {q.rows()}; }
};

}  // namespace

TEST_CASE("h2o: accumulated attention from queries equals the closed form, in any query tile") {
  Index const n = 9;
  auto cache = kvc::tools::HostCache<float>::random({2, 2, n, 4}, 3);
  ZeroQueries const zq({2, 4, n, 4});  // every prompt query, post-RoPE zeros: row i pays 1/(i+1) to slots 0..i
  for (Index tile : {Index{1}, Index{4}, Index{256}}) {
    OwnedState state(2, 2, n);
    kvc::H2OScorer<> const s{state.view, tile};
    auto const obs = kvc::observe(zq.view());
    kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, s, cache.ext, obs));
    REQUIRE(kvc::update(kvc::Cpu{}, s, cache.view(), obs, ws.get()).ok());
    for (Index bh = 0; bh < 4; ++bh)
      for (Index j = 0; j < n; ++j) {
        double want = 0.0;
        for (Index i = j; i < n; ++i)
          want += 1.0 / static_cast<double>(i + 1);
        CHECK_THAT(state.acc[bh * n + j], WithinAbs(want, 1e-5));
      }
    CHECK(state.tracked == std::vector<Index>{n, n, n, n});
  }
}

TEST_CASE("h2o reference=kvpress: ObservedAttention divides the column sums by the queries that see each slot") {
  Index const n = 7;
  auto cache = kvc::tools::HostCache<float>::random({1, 2, n, 4}, 5);
  ZeroQueries const zq({1, 2, n, 4});
  kvc::ObservedAttentionScorer s;
  s.query_tile = 3;
  auto const obs = kvc::observe(zq.view());
  kvc::test::OwnedScores out(1, 2, n);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, cache.ext, obs));
  REQUIRE(kvc::score(kvc::Cpu{}, s, cache.view(), obs, out.span, ws.get()).ok());
  for (Index h = 0; h < 2; ++h)
    for (Index j = 0; j < n; ++j) {
      double sum = 0.0;
      for (Index i = j; i < n; ++i)
        sum += 1.0 / static_cast<double>(i + 1);
      CHECK_THAT(out.data[h * n + j], WithinAbs(sum / static_cast<double>(n - j), 1e-6));
    }
}

TEST_CASE("h2o: processing a prompt token by token is greedy and bounded (original_baselines 1.9)") {
  // Properties of original_baselines §1.9: the cache never exceeds hh + recent, the last `recent` tokens are
  // present, one token leaves per step once full, positions stay ascending, and the accumulator sums attention.
  Index const n = 40, hh = 4, recent = 3;
  auto prompt = kvc::tools::HostCache<float>::random({1, 2, n, 8}, 9);
  kvc::test::OwnedQueries<float> q({1, 4, n, 8});
  auto const vals = kvc::tools::random_values<float>(static_cast<Index>(q.data.size()), 10, 2.0f);
  std::copy(vals.begin(), vals.end(), q.data.begin());

  kvc::tools::HostCache<float> work(kvc::KVExtents{1, 2, hh + recent + 1, 8});
  work.track(0);
  OwnedState state(1, 2, hh + recent + 1);
  kvc::H2OScorer<> const s{state.view};
  for (Index t = 0; t < n; ++t) {
    REQUIRE(kvc::append(kvc::Cpu{}, work.view(), prompt.view(), t, 1).ok());
    kvc::WindowQueries<float> const wq{
        {q.data.data() + t * 8, kvc::StridedLayout{{1, 4, 1, 8}, 4 * n * 8, n * 8, 8}}, {}, &t};
    auto const obs = kvc::observe(wq);
    kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, s, work.ext, obs));
    REQUIRE(kvc::update(kvc::Cpu{}, s, work.view(), obs, ws.get()).ok());
    evict(s, work.view(), hh, recent);
    for (Index h = 0; h < 2; ++h) {
      auto const pos = work.head_positions(0, h);
      REQUIRE(static_cast<Index>(pos.size()) == std::min(t + 1, hh + recent));
      CHECK(pos.back() == t);
      CHECK(std::is_sorted(pos.begin(), pos.end()));
      if (t + 1 >= recent)
        CHECK(pos[pos.size() - static_cast<std::size_t>(recent)] == t - recent + 1);
    }
  }
}

TEST_CASE("h2o: on_evict refuses a plan of another shape than the cache (it would write past `tracked`)") {
  // A 1 x 2 cache and its state (`tracked` holds 2 entries); a 1 x 4 plan has 4 counts.
  kvc::tools::HostCache<float> cache(kvc::KVExtents{1, 2, 8, 2});
  OwnedState state(1, 2, 8);
  kvc::H2OScorer<> const s{state.view};
  kvc::test::OwnedPlan wide(1, 4, 8);
  std::fill(wide.count.begin(), wide.count.end(), 3);
  kvc::Status const st = kvc::on_evict(kvc::Cpu{}, s, cache.view(), wide.plan, {});
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("`plan`") != std::string::npos);
  // The kernel checks it too (it is the one that indexes `tracked` by the plan's heads).
  CHECK(kvc::Kernel<kvc::H2OScorer<>, kvc::Cpu>::on_evict(kvc::Cpu{}, s, cache.view(), wide.plan, {}).code() ==
        kvc::Errc::invalid_argument);
  CHECK(state.tracked == std::vector<Index>{0, 0});
  // A plan of the cache's shape is taken as it is.
  kvc::test::OwnedPlan fit(1, 2, 8);
  fit.count[0] = 3;
  fit.count[1] = 5;
  REQUIRE(kvc::on_evict(kvc::Cpu{}, s, cache.view(), fit.plan, {}).ok());
  CHECK(state.tracked == std::vector<Index>{3, 5});
}
