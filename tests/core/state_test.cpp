// SPDX-License-Identifier: Apache-2.0
// tests/core/state_test.cpp mirrors the state hooks of include/kvc/core/scorer.hpp: kvc::score is pure for stateful
// scorers, kvc::update / kvc::on_evict reach the kernel's hooks (and are no-ops for stateless scorers), and per-token
// state travels through kvc::compact with the rows. The scorer here is a test-only toy, not a library policy.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/core/scorer.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <string_view>
#include <type_traits>
#include <vector>

using kvc::Index;

namespace {

/// Scores are an accumulator the caller owns; update() adds each valid key's first channel to it; on_evict()
/// counts the tokens a plan drops.
struct AccumulatorScorer {
  static constexpr kvc::Needs needs = kvc::Needs::keys;
  static constexpr std::string_view name = "test_accumulator";
  static constexpr bool stateful = true;

  kvc::TokenArray<float> acc;  ///< [batch, heads, tokens]
  Index* evicted = nullptr;    ///< tokens evicted so far (caller-owned)
  Index* updates = nullptr;    ///< update() calls so far (caller-owned)
};

/// Stateless, with a kernel that has neither update nor on_evict: the hooks must not even be instantiated.
struct ConstantScorer {
  static constexpr kvc::Needs needs = kvc::Needs::keys;
  static constexpr std::string_view name = "test_constant";
  static constexpr bool stateful = false;
};

}  // namespace

namespace kvc {

template <>
struct Kernel<AccumulatorScorer, Cpu> {
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const&, AccumulatorScorer const&, KVExtents const&, Obs const&) {
    return 0;
  }
  template <KVCacheView C, class Obs>
  static Status run(Cpu const&, AccumulatorScorer const& s, C const&, Obs const&, ScoreSpan<HostSpace> out, Workspace) {
    for (Index b = 0; b < out.batch; ++b)
      for (Index h = 0; h < out.heads; ++h)
        for (Index t = 0; t < out.tokens; ++t)
          out(b, h, t) = t < out.length(b, h) ? s.acc(b, h, t) : -std::numeric_limits<float>::infinity();
    return {};
  }
  template <KVCacheView C, class Obs>
  static Status update(Cpu const&, AccumulatorScorer const& s, C const& cache, Obs const&, Workspace) {
    KVExtents const e = cache.keys.extents();
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h)
        for (Index t = 0; t < cache.length(b, h); ++t)
          s.acc(b, h, t) += to_float(cache.keys.row(b, h, t)[0]);
    ++*s.updates;
    return {};
  }
  template <KVCacheView C>
  static Status on_evict(Cpu const&, AccumulatorScorer const& s, C const& cache, KeepPlan<HostSpace> const& plan,
                         Workspace) {
    for (Index b = 0; b < plan.batch; ++b)
      for (Index h = 0; h < plan.heads; ++h)
        *s.evicted += cache.length(b, h) - plan.kept(b, h);
    return {};
  }
};

template <>
struct Kernel<ConstantScorer, Cpu> {
  template <class Obs>
  static std::size_t workspace_bytes(Cpu const&, ConstantScorer const&, KVExtents const&, Obs const&) {
    return 0;
  }
  template <KVCacheView C, class Obs>
  static Status run(Cpu const&, ConstantScorer const&, C const&, Obs const&, ScoreSpan<HostSpace> out, Workspace) {
    for (Index i = 0; i < out.size(); ++i)
      out.data[i] = 1.0f;
    return {};
  }
};

}  // namespace kvc

namespace {

static_assert(kvc::Scorer<AccumulatorScorer> && kvc::StatefulScorer<AccumulatorScorer>);
static_assert(kvc::Scorer<ConstantScorer> && !kvc::StatefulScorer<ConstantScorer>);
static_assert(!kvc::StatefulScorer<kvc::KeyDiffScorer>);  // no `stateful` member at all

/// The toy's state: an accumulator over a cache's slots plus the two counters.
struct State {
  std::vector<float> acc;
  Index evicted = 0, updates = 0;
  AccumulatorScorer scorer;
  State(Index b, Index h, Index n, float start) : acc(static_cast<std::size_t>(b * h * n)) {
    for (std::size_t i = 0; i < acc.size(); ++i)
      acc[i] = start + static_cast<float>(i % 7) - 0.25f * static_cast<float>(i % 3);
    scorer = {{acc.data(), b, h, n}, &evicted, &updates};
  }
};

std::vector<float> scores_of(AccumulatorScorer const& s, kvc::tools::HostCache<float> const& c) {
  kvc::test::OwnedScores out(c.ext.batch, c.ext.heads, c.ext.tokens);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, c.ext));
  REQUIRE(kvc::score(kvc::Cpu{}, s, c.view(), out.span, ws.get()).ok());
  return out.data;
}

}  // namespace

TEST_CASE("state: kvc::score is pure for a stateful scorer", "[core][state]") {
  auto c = kvc::tools::HostCache<float>::random({2, 2, 6, 4}, 1);
  c.lengths = {6, 4};
  State st(2, 2, 6, 0.5f);
  auto const acc_before = st.acc;
  auto const a = scores_of(st.scorer, c);
  auto const b = scores_of(st.scorer, c);
  CHECK(a == b);
  CHECK(st.acc == acc_before);
  CHECK(st.updates == 0);
  CHECK(st.evicted == 0);
  for (Index t = 0; t < 6; ++t) {
    CHECK(a[static_cast<std::size_t>(t)] == st.acc[static_cast<std::size_t>(t)]);
    CHECK(a[static_cast<std::size_t>(2 * 6 + t)] ==
          (t < 4 ? st.acc[static_cast<std::size_t>(2 * 6 + t)] : -std::numeric_limits<float>::infinity()));
  }
}

TEST_CASE("state: kvc::update reaches the kernel's hook and changes the state", "[core][state]") {
  auto c = kvc::tools::HostCache<float>::random({1, 2, 5, 3}, 2);
  c.lengths = {5, 2};
  c.per_head = true;
  State st(1, 2, 5, 0.0f);
  auto const before = st.acc;
  REQUIRE(kvc::update(kvc::Cpu{}, st.scorer, c.view(), kvc::NoObservations{}, kvc::Workspace{}).ok());
  CHECK(st.updates == 1);
  for (Index h = 0; h < 2; ++h)
    for (Index t = 0; t < 5; ++t) {
      std::size_t const i = static_cast<std::size_t>(h * 5 + t);
      bool const valid = t < (h == 0 ? 5 : 2);
      CHECK(st.acc[i] == before[i] + (valid ? c.k[i * 3] : 0.0f));
    }
  auto const s = scores_of(st.scorer, c);  // the next score sees the new state
  CHECK(s[0] == st.acc[0]);
}

TEST_CASE("state: kvc::on_evict sees the plan and kvc::compact moves the accumulator with the rows", "[core][state]") {
  kvc::KVExtents const e{2, 2, 8, 4};
  auto c = kvc::tools::HostCache<float>::random(e, 3);
  c.track(8);
  c.lengths = {8, 6, 7, 8};
  State st(2, 2, 8, 1.0f);
  REQUIRE(kvc::update(kvc::Cpu{}, st.scorer, c.view(), kvc::NoObservations{}, kvc::Workspace{}).ok());

  // The engine's loop: compress with the stateful scorer, tell it what goes, then compact rows and state together.
  kvc::Press const press{st.scorer, kvc::TopKSelector{kvc::FixedBudget{3}}};
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
  kvc::test::OwnedPlan plan(2, 2, 8);
  REQUIRE(kvc::compress(kvc::Cpu{}, press, c.view(), plan.plan, ws.get()).ok());
  REQUIRE(kvc::on_evict(kvc::Cpu{}, st.scorer, c.view(), plan.plan, kvc::Workspace{}).ok());
  CHECK(st.evicted == (8 - 3) + (6 - 3) + (7 - 3) + (8 - 3));

  auto const old = c;
  auto const old_acc = st.acc;
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, c.view(), st.scorer.acc).ok());
  CHECK(c.lengths == std::vector<Index>{3, 3, 3, 3});
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 2; ++h) {
      auto const kept = plan.kept(b, h);
      REQUIRE(kept.size() == 3);
      // The three highest accumulator values of the head were kept (the toy's scores are the accumulator).
      std::vector<float> valid(old_acc.begin() + (b * 2 + h) * 8,
                               old_acc.begin() + (b * 2 + h) * 8 + old.view().length(b, h));
      std::sort(valid.rbegin(), valid.rend());
      for (Index j = 0; j < 3; ++j) {
        Index const from = kept[static_cast<std::size_t>(j)];
        std::size_t const dst = static_cast<std::size_t>((b * 2 + h) * 8 + j),
                          src = static_cast<std::size_t>((b * 2 + h) * 8 + from);
        CHECK(st.acc[dst] == old_acc[src]);
        CHECK(c.positions[dst] == old.positions[src]);
        CHECK(std::equal(c.k.begin() + static_cast<std::ptrdiff_t>(dst * 4),
                         c.k.begin() + static_cast<std::ptrdiff_t>(dst * 4 + 4),
                         old.k.begin() + static_cast<std::ptrdiff_t>(src * 4)));
        CHECK(st.acc[dst] >= valid[2]);
      }
    }
  // Scores after compaction are the moved state; the evicted slots are padding now.
  auto const s = scores_of(st.scorer, c);
  for (Index bh = 0; bh < 4; ++bh)
    for (Index t = 0; t < 8; ++t)
      CHECK(s[static_cast<std::size_t>(bh * 8 + t)] ==
            (t < 3 ? st.acc[static_cast<std::size_t>(bh * 8 + t)] : -std::numeric_limits<float>::infinity()));
  // An accumulator of the wrong shape is rejected before anything moves.
  std::vector<float> small(2 * 2 * 4);
  auto const frozen = c;
  CHECK(kvc::compact(kvc::Cpu{}, plan.plan, c.view(), kvc::TokenArray<float>{small.data(), 2, 2, 4}).code() ==
        kvc::Errc::invalid_argument);
  CHECK(c.k == frozen.k);
}

TEST_CASE("state: the hooks are no-ops returning ok for stateless scorers", "[core][state]") {
  auto c = kvc::tools::HostCache<float>::random({1, 1, 4, 2}, 4);
  auto const before = c;
  kvc::test::OwnedPlan plan = kvc::test::plan_of(1, 1, 4, {{0, 2}});
  // ConstantScorer's kernel has no update/on_evict: these compile only because the hooks skip stateless scorers.
  CHECK(kvc::update(kvc::Cpu{}, ConstantScorer{}, c.view(), kvc::NoObservations{}, kvc::Workspace{}).ok());
  CHECK(kvc::on_evict(kvc::Cpu{}, ConstantScorer{}, c.view(), plan.plan, kvc::Workspace{}).ok());
  CHECK(kvc::update(kvc::Cpu{}, kvc::KeyDiffScorer{}, c.view(), kvc::NoObservations{}, kvc::Workspace{}).ok());
  CHECK(kvc::on_evict(kvc::Cpu{}, kvc::KeyDiffScorer{}, c.view(), plan.plan, kvc::Workspace{}).ok());
  CHECK(c.k == before.k);
  using UpdateResult =
      decltype(kvc::update(kvc::Cpu{}, ConstantScorer{}, c.view(), kvc::NoObservations{}, kvc::Workspace{}));
  static_assert(std::is_same_v<UpdateResult, kvc::Status>);
}
