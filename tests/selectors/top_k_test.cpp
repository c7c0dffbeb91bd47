// SPDX-License-Identifier: Apache-2.0
// tests/selectors/top_k_test.cpp mirrors include/kvc/selectors/top_k.hpp: the selector contract (kvc::Selector).
#include <kvc/backend/cpu/selectors/top_k.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

using kvc::Index;
float const inf = std::numeric_limits<float>::infinity();

template <class Sel>
std::vector<Index> run(Sel sel, std::vector<float> scores, Index capacity = -1) {
  Index const n = static_cast<Index>(scores.size());
  kvc::test::OwnedPlan plan(1, 1, capacity < 0 ? n : capacity);
  kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 1, 1, n));
  REQUIRE(kvc::select(kvc::Cpu{}, sel, kvc::ScoreSpan<>{scores.data(), 1, 1, n}, plan.plan, ws.get()).ok());
  return plan.kept(0, 0);
}

/// Brute-force reference: sort all (score, index) by the library order, take k, sort ascending.
std::vector<Index> reference(std::vector<float> const& s, Index k) {
  std::vector<Index> idx(s.size());
  std::iota(idx.begin(), idx.end(), 0);
  auto rank = [](float x) { return std::isnan(x) ? -inf : x; };
  std::stable_sort(idx.begin(), idx.end(), [&](Index a, Index b) { return rank(s[a]) > rank(s[b]); });
  idx.resize(static_cast<std::size_t>(k));
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace

TEST_CASE("top_k: hand-computed selection, ascending output", "[selectors][top_k]") {
  std::vector<float> const s = {0.1f, 0.9f, 0.5f, 0.7f, 0.3f};
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{2}}, s) == std::vector<Index>{1, 3});
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{3}}, s) == std::vector<Index>{1, 2, 3});
}

TEST_CASE("top_k: RatioBudget keeps floor(n * (1 - r)) like kvpress", "[selectors][top_k]") {
  std::vector<float> s(10);
  std::iota(s.begin(), s.end(), 0.0f);
  CHECK(run(kvc::TopKSelector{kvc::RatioBudget{0.25}}, s).size() == 7);  // 7.5 -> 7
  CHECK(run(kvc::TopKSelector{kvc::RatioBudget{0.0}}, s).size() == 10);
  CHECK(run(kvc::TopKSelector{kvc::RatioBudget{1.0}}, s).empty());
  CHECK(run(kvc::TopKSelector{kvc::RatioBudget{0.7}}, s) == std::vector<Index>{7, 8, 9});  // 3.0000000000000004 -> 3
}

TEST_CASE("top_k: budget 0 keeps nothing, n <= budget keeps everything", "[selectors][top_k]") {
  std::vector<float> const s = {3, 1, 2};
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{0}}, s).empty());
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{3}}, s) == std::vector<Index>{0, 1, 2});
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{100}}, s) == std::vector<Index>{0, 1, 2});
}

TEST_CASE("top_k: ties keep the lower index, NaN ranks as -inf", "[selectors][top_k]") {
  std::vector<float> const ties = {0.145f, 0.145f, 0.05f, 0.7f, 0.7f, 0.7f};
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{4}}, ties) == std::vector<Index>{0, 3, 4, 5});
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{2}}, ties) == std::vector<Index>{3, 4});
  float const nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> const with_nan = {nan, -inf, 1.0f, nan, 0.0f};
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{2}}, with_nan) == std::vector<Index>{2, 4});
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{3}}, with_nan) == std::vector<Index>{0, 2, 4});  // NaN ties -inf
}

TEST_CASE("top_k: protected sinks and recent tokens are always kept, even past the budget", "[selectors][top_k]") {
  std::vector<float> const s = {0, 0, 9, 8, 7, 0, 0, 0};
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{4}, 1, 1}, s) == std::vector<Index>{0, 2, 3, 7});
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{0}, 2, 1}, s) == std::vector<Index>{0, 1, 7});  // budget 0
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{3}, 5, 5}, s).size() == 8);  // windows cover everything
}

TEST_CASE("top_k: agrees with a brute-force sort on random scores with many ties", "[selectors][top_k]") {
  kvc::tools::Rng rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    Index const n = 1 + static_cast<Index>(rng.next() % 60);
    std::vector<float> s(static_cast<std::size_t>(n));
    for (float& x : s)
      x = static_cast<float>(rng.next() % 7);  // many ties
    Index const k = static_cast<Index>(rng.next() % static_cast<std::uint64_t>(n + 2));
    CHECK(run(kvc::TopKSelector{kvc::FixedBudget{k}}, s) == reference(s, std::min(k, n)));
  }
}

TEST_CASE("top_k: the radix selection resolves keys that share their high bits, NaN, signed zeros and infinities",
          "[selectors][top_k]") {
  // Scores 1 + j * 2^-23 (j < 3000) differ only in their low mantissa bits, so the threshold is found in the second
  // or third radix pass; duplicates, NaN (= -inf), -0 (= +0) and infinities mix in.
  kvc::tools::Rng rng(11);
  float const special[] = {std::numeric_limits<float>::quiet_NaN(), -0.0f, 0.0f, inf, -inf, 1.0f};
  for (int trial = 0; trial < 300; ++trial) {
    Index const n = 1 + static_cast<Index>(rng.next() % 5000);
    std::vector<float> s(static_cast<std::size_t>(n));
    for (float& x : s) {
      std::uint64_t const r = rng.next() % 100;
      x = r < 6 ? special[r] : 1.0f + static_cast<float>(rng.next() % (trial % 3 == 0 ? 40 : 3000)) * 0x1p-23f;
      if (trial % 5 == 0)
        x = -x;  // the negative half of the key space
    }
    Index const k = static_cast<Index>(rng.next() % static_cast<std::uint64_t>(n + 1));
    Index const sink = static_cast<Index>(rng.next() % 4), recent = static_cast<Index>(rng.next() % 4);
    // Reference: protected sinks and recent tokens, plus the best of the middle by a stable sort.
    Index const sink_end = std::min(sink, n), recent_begin = std::max(n - recent, sink_end);
    Index const keep = std::min(n, std::max(k, sink_end + (n - recent_begin)));
    std::vector<float> const middle(s.begin() + sink_end, s.begin() + recent_begin);
    std::vector<Index> expected;
    for (Index t = 0; t < sink_end; ++t)
      expected.push_back(t);
    for (Index i : reference(middle, keep - sink_end - (n - recent_begin)))
      expected.push_back(sink_end + i);
    for (Index t = recent_begin; t < n; ++t)
      expected.push_back(t);
    CHECK(run(kvc::TopKSelector{kvc::FixedBudget{k}, sink, recent}, s) == expected);
  }
}

TEST_CASE("top_k: ragged lengths never keep padding, per-head budgets", "[selectors][top_k]") {
  std::vector<float> s = {5, 4, 3, 2, 1, 0, /* row 1 */ 0, 1, 2, 9, 9, 9};
  std::vector<Index> lengths = {6, 3};
  kvc::ScoreSpan<> span{s.data(), 2, 1, 6, lengths.data()};
  kvc::test::OwnedPlan plan(2, 1, 6);
  kvc::test::OwnedWorkspace ws(
      kvc::select_workspace_bytes(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{2}}, 2, 1, 6));
  REQUIRE(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{2}}, span, plan.plan, ws.get()).ok());
  CHECK(plan.kept(0, 0) == std::vector<Index>{0, 1});
  CHECK(plan.kept(1, 0) == std::vector<Index>{1, 2});
  std::vector<Index> table = {1, 3};  // [batch, heads]
  REQUIRE(
      kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::PerHeadBudget{table.data(), 1}}, span, plan.plan, ws.get()).ok());
  CHECK(plan.kept(0, 0) == std::vector<Index>{0});
  CHECK(plan.kept(1, 0) == std::vector<Index>{0, 1, 2});
}

TEST_CASE("top_k: bad budgets, small plans and missing workspace are errors", "[selectors][top_k]") {
  std::vector<float> s = {1, 2, 3};
  kvc::ScoreSpan<> span{s.data(), 1, 1, 3};
  kvc::test::OwnedPlan plan(1, 1, 3), small(1, 1, 1), wrong(2, 1, 3);
  kvc::test::OwnedWorkspace ws(
      kvc::select_workspace_bytes(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{2}}, 1, 1, 3));
  CHECK(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::RatioBudget{1.5}}, span, plan.plan, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::RatioBudget{std::nan("")}}, span, plan.plan, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{-1}}, span, plan.plan, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{2}, -1}, span, plan.plan, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{2}}, span, small.plan, ws.get()).code() ==
        kvc::Errc::out_of_capacity);
  CHECK(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{2}}, span, wrong.plan, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{2}}, span, plan.plan, {}).code() ==
        kvc::Errc::out_of_capacity);
}

TEST_CASE("top_k: 64-bit budgets and counts", "[selectors][top_k]") {
  // A budget past 2^32 behaves as "keep everything" without overflow.
  CHECK(run(kvc::TopKSelector{kvc::FixedBudget{Index{1} << 40}}, {1, 2}) == std::vector<Index>{0, 1});
  CHECK(kvc::RatioBudget{0.5}.keep(0, 0, Index{1} << 40) == Index{1} << 39);
}

namespace {
/// A value budget that depends on the head: head h keeps 2 + 3h tokens (a schedule computed from (b, h)).
struct HeadSchedule {
  constexpr Index keep(Index, Index h, Index n) const noexcept { return std::min(n, 2 + 3 * h); }
  constexpr kvc::Status check() const noexcept { return {}; }
};
}  // namespace

TEST_CASE("top_k: the host capacity bound is exact only for ratio and fixed budgets, table shapes are checked",
          "[selectors][top_k]") {
  // Ratio 0.5 over 100 tokens keeps at most 50; with 60 protected tokens, 60. Fixed 30 keeps 30.
  CHECK(kvc::detail::top_k_capacity_bound(kvc::TopKSelector{kvc::RatioBudget{0.5}}, 100) == 50);
  CHECK(kvc::detail::top_k_capacity_bound(kvc::TopKSelector{kvc::RatioBudget{0.5}, 20, 40}, 100) == 60);
  CHECK(kvc::detail::top_k_capacity_bound(kvc::TopKSelector{kvc::FixedBudget{30}}, 100) == 30);
  // A budget that depends on the head is bounded by the token count: head 0's answer would under-size the plan.
  CHECK(kvc::detail::top_k_capacity_bound(kvc::TopKSelector<HeadSchedule>{}, 100) == 100);
  // A per-head budget table or length table built for another head count is rejected.
  std::vector<float> scores(2 * 3 * 10, 1.0f);
  std::vector<Index> const table = {1, 2};
  kvc::test::OwnedPlan plan(2, 3, 10);
  kvc::TopKSelector<kvc::PerHeadBudget<>> const sel{kvc::PerHeadBudget<>{table.data(), 1}};
  kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 2, 3, 10));
  CHECK(kvc::select(kvc::Cpu{}, sel, kvc::ScoreSpan<>{scores.data(), 2, 3, 10}, plan.plan, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  std::vector<Index> lengths(2 * 2, 10);
  kvc::ScoreSpan<> const wrong{scores.data(), 2, 3, 10, kvc::head_lengths(lengths.data(), 2)};
  CHECK(kvc::select(kvc::Cpu{}, kvc::TopKSelector{kvc::FixedBudget{3}}, wrong, plan.plan, ws.get()).code() ==
        kvc::Errc::invalid_argument);
}
