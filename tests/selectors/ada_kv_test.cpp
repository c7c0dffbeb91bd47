// SPDX-License-Identifier: Apache-2.0
// tests/selectors/ada_kv_test.cpp mirrors include/kvc/selectors/ada_kv.hpp: AdaKV's allocation in both behaviours,
// original_baselines.md §5.6 (properties) and §5.7 (worked examples), and the selection it feeds.
#include <kvc/backend/cpu/selectors/ada_kv.hpp>

#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace {

using kvc::Index;
using kvc::Reference;

/// Per-head totals of kvc::allocate for scores [1, heads, n] (all valid).
template <kvc::Budget B>
std::vector<Index> allocate(kvc::AdaKVSelector<B> const& sel, std::vector<float> scores, Index heads) {
  Index const n = static_cast<Index>(scores.size()) / heads;
  std::vector<Index> table(static_cast<std::size_t>(heads), -1);
  kvc::test::OwnedWorkspace ws(kvc::allocate_workspace_bytes(kvc::Cpu{}, sel, 1, heads, n));
  REQUIRE(kvc::allocate(kvc::Cpu{}, sel, kvc::ScoreSpan<>{scores.data(), 1, heads, n}, table.data(), ws.get()).ok());
  return table;
}

// §5.7, first example: two heads of 10 tokens, B = 5, α = 0.2.
std::vector<float> const example_one = {0.30f,  0.25f,  0.20f, 0.15f, 0.12f,  0.10f,  0.09f,  0.08f,  0.01f,  0.005f,
                                        0.085f, 0.082f, 0.02f, 0.01f, 0.009f, 0.008f, 0.007f, 0.006f, 0.004f, 0.003f};

std::vector<float> example_two() {  // §5.7, second: α = 0.5, B = 5
  std::vector<float> s = {0.9f, 0.8f, 0.7f, 0.6f, 0.5f, 0.4f, 0.3f, 0.2f, 0.15f, 0.001f, 0.12f};
  s.resize(20, 0.0001f);
  return s;
}

}  // namespace

TEST_CASE("AdaKV worked example one: authors (7, 3), kvpress (8, 2)") {
  CHECK(allocate(kvc::AdaKVSelector{kvc::FixedBudget{5}, 0.2}, example_one, 2) == std::vector<Index>{7, 3});
  CHECK(allocate(kvc::AdaKVSelector{kvc::FixedBudget{5}, 0.2, Reference::kvpress}, example_one, 2) ==
        std::vector<Index>{8, 2});
}

TEST_CASE("AdaKV worked example two: half-to-even rounding gives (6, 2), kvpress (8, 2)") {
  CHECK(allocate(kvc::AdaKVSelector{kvc::FixedBudget{5}, 0.5}, example_two(), 2) == std::vector<Index>{6, 2});
  CHECK(allocate(kvc::AdaKVSelector{kvc::FixedBudget{5}, 0.5, Reference::kvpress}, example_two(), 2) ==
        std::vector<Index>{8, 2});
}

TEST_CASE("AdaKV authors: the window is kept on top of each head's prefix budget") {
  // §5.7 example one with a 2-token window after each head's 10 prefix tokens: C = 7 per head gives B = 5.
  std::vector<float> s;
  for (Index h = 0; h < 2; ++h) {
    s.insert(s.end(), example_one.begin() + h * 10, example_one.begin() + h * 10 + 10);
    s.insert(s.end(), {0.0f, 0.0f});  // window scores are irrelevant
  }
  auto const sel = kvc::AdaKVSelector{kvc::FixedBudget{7}, 0.2, Reference::authors, 0, 2};
  CHECK(allocate(sel, s, 2) == std::vector<Index>{9, 5});
  kvc::test::OwnedPlan plan(1, 2, 12);
  kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 1, 2, 12));
  REQUIRE(kvc::select(kvc::Cpu{}, sel, kvc::ScoreSpan<>{s.data(), 1, 2, 12}, plan.plan, ws.get()).ok());
  CHECK(plan.kept(0, 0) == std::vector<Index>{0, 1, 2, 3, 4, 5, 6, 10, 11});
  CHECK(plan.kept(0, 1) == std::vector<Index>{0, 1, 2, 10, 11});
}

TEST_CASE("AdaKV properties of §5.6 on random scores") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  Index const heads = 4, n = 50, budget = 12;
  std::vector<float> s(static_cast<std::size_t>(heads * n));
  for (int trial = 0; trial < 20; ++trial) {
    for (float& x : s)
      x = u(rng) * u(rng);
    // c_h: a brute-force global top-(heads * budget) over the flattened scores.
    std::vector<Index> order(s.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) { return s[a] > s[b]; });
    std::vector<Index> c(heads, 0);
    for (Index i = 0; i < heads * budget; ++i)
      ++c[order[i] / n];
    // α = 0: b = c exactly, conserving heads * B.
    CHECK(allocate(kvc::AdaKVSelector{kvc::FixedBudget{budget}, 0.0}, s, heads) == c);
    // α = 1: uniform.
    CHECK(allocate(kvc::AdaKVSelector{kvc::FixedBudget{budget}, 1.0}, s, heads) == std::vector<Index>(heads, budget));
    // Any α: the floor holds, and scaling every score by one constant changes nothing.
    auto const sel = kvc::AdaKVSelector{kvc::FixedBudget{budget}, 0.3};
    auto const b = allocate(sel, s, heads);
    for (Index h = 0; h < heads; ++h)
      CHECK(b[h] >= static_cast<Index>(0.3 * budget));
    std::vector<float> scaled = s;
    for (float& x : scaled)
      x *= 3.5f;
    CHECK(allocate(sel, scaled, heads) == b);
    // kvpress: exactly heads * kept, each head at least floor(α kept).
    auto const kv = allocate(kvc::AdaKVSelector{kvc::FixedBudget{budget}, 0.3, Reference::kvpress}, s, heads);
    CHECK(std::accumulate(kv.begin(), kv.end(), Index{0}) == heads * budget);
    for (Index h = 0; h < heads; ++h)
      CHECK(kv[h] >= static_cast<Index>(0.3 * budget));
  }
}

TEST_CASE("AdaKV: bad parameters and tables give clear errors before anything is written") {
  std::vector<float> s(20, 1.0f);
  std::vector<Index> table(2, -1);
  kvc::test::OwnedWorkspace ws(1 << 12);
  kvc::ScoreSpan<> const span{s.data(), 1, 2, 10};
  auto code = [&](auto const& sel, Index* t) { return kvc::allocate(kvc::Cpu{}, sel, span, t, ws.get()); };
  auto const bad_alpha = code(kvc::AdaKVSelector{kvc::FixedBudget{5}, 1.5}, table.data());
  CHECK(bad_alpha.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(bad_alpha.message()).find("alpha_safeguard") != std::string::npos);
  CHECK(code(kvc::AdaKVSelector{kvc::FixedBudget{-1}, 0.2}, table.data()).code() == kvc::Errc::invalid_argument);
  CHECK(code(kvc::AdaKVSelector{kvc::RatioBudget{2.0}, 0.2}, table.data()).code() == kvc::Errc::invalid_argument);
  CHECK(code(kvc::AdaKVSelector{kvc::FixedBudget{5}, 0.2, Reference::authors, -1, 0}, table.data()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(std::string(code(kvc::AdaKVSelector{kvc::FixedBudget{5}, 0.2}, nullptr).message()).find("table") !=
        std::string::npos);
  CHECK(table == std::vector<Index>{-1, -1});
  std::vector<Index> lengths{4, 11};  // past the 10 slots
  kvc::ScoreSpan<> const bad_lengths{s.data(), 1, 2, 10, kvc::head_lengths(lengths.data(), 2)};
  CHECK(
      kvc::allocate(kvc::Cpu{}, kvc::AdaKVSelector{kvc::FixedBudget{5}}, bad_lengths, table.data(), ws.get()).code() ==
      kvc::Errc::invalid_argument);
  kvc::test::OwnedWorkspace tiny(8);
  CHECK(kvc::allocate(kvc::Cpu{}, kvc::AdaKVSelector{kvc::FixedBudget{5}}, span, table.data(), tiny.get()).code() ==
        kvc::Errc::out_of_capacity);
  CHECK(table == std::vector<Index>{-1, -1});
}
