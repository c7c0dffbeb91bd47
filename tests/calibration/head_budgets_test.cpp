// SPDX-License-Identifier: Apache-2.0
// tests/calibration/head_budgets_test.cpp mirrors include/kvc/calibration/head_budgets.hpp: UNComp's per-head budgets
// (shared/specs/uncomp.md §2.6, Table 9, §7.6, §7.7 and §8 properties 11-15). The lists come from the spec: the
// closed form [643, 569, …, 125], the paper's [640, 566, …, 122], the authors' [640, 567, …, 129] and Table 9;
// rounding cases are worked out by hand in the comments.
#include <kvc/calibration/head_budgets.hpp>
#include <kvc/calibration/head_groups.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace {

using Catch::Matchers::WithinAbs;
using kvc::BudgetSchedule;
using kvc::HeadBudgetSpec;
using kvc::Index;
using List = std::vector<Index>;

std::size_t at(Index i) {
  return static_cast<std::size_t>(i);
}

List budgets(HeadBudgetSpec const& spec, List const& group_of_head, Index min_tokens = 0) {
  List b(group_of_head.size());
  kvc::Status const st =
      kvc::head_budgets(spec, group_of_head.data(), static_cast<Index>(group_of_head.size()), min_tokens, b.data());
  INFO(st.message());
  REQUIRE(st.ok());
  return b;
}

/// Head h of `heads` in group h / (heads / groups) (equal contiguous groups).
List equal_groups(Index heads, Index groups) {
  List g(at(heads));
  for (Index h = 0; h < heads; ++h)
    g[at(h)] = h / (heads / groups);
  return g;
}

Index sum(List const& v) {
  return std::accumulate(v.begin(), v.end(), Index{0});
}

}  // namespace

TEST_CASE("head budgets: closed forms of the spec (property 13)", "[calibration][budgets]") {
  std::vector<double> per(8);
  // Budget-preserving: B̄ = 384, M = 8, Δ = 74 -> [643, 569, 495, 421, 347, 273, 199, 125].
  HeadBudgetSpec const preserving{.average = 384, .groups = 8, .step = 74};
  REQUIRE(kvc::group_budgets(preserving, nullptr, per.data()).ok());
  std::vector<double> const want{643, 569, 495, 421, 347, 273, 199, 125};
  for (std::size_t g = 0; g < 8; ++g)
    CHECK_THAT(per[g], WithinAbs(want[g], 1e-12));
  List const sizes{4, 4, 4, 4, 4, 4, 4, 4};
  REQUIRE(kvc::group_budgets(preserving, sizes.data(), per.data()).ok());
  CHECK_THAT(per[0], WithinAbs(643.0, 1e-12));
  List const b = budgets(preserving, equal_groups(32, 8));
  for (Index h = 0; h < 32; ++h)
    CHECK(b[at(h)] == static_cast<Index>(want[at(h / 4)]));
  CHECK(sum(b) == 32 * 384);

  // Paper: N_1 = 640, N_{g+1} = N_g − 74 -> [640, 566, …, 122] (mean 381).
  HeadBudgetSpec const paper{.groups = 8, .step = 74, .largest = 640, .schedule = BudgetSchedule::paper};
  REQUIRE(kvc::group_budgets(paper, nullptr, per.data()).ok());
  List const paper_list{640, 566, 492, 418, 344, 270, 196, 122};
  for (std::size_t g = 0; g < 8; ++g)
    CHECK(per[g] == static_cast<double>(paper_list[g]));
  List const pb = budgets(paper, equal_groups(32, 8));
  CHECK(sum(pb) == 32 * 381);
  CHECK(pb[0] == 640);
  CHECK(pb[31] == 122);

  // The authors' list mode: [640, 567, …, 129] (mean 384.5).
  Index m = 0;
  Index const* authors = kvc::head_budget_preset("authors_384", m);
  REQUIRE(authors != nullptr);
  REQUIRE(m == 8);
  HeadBudgetSpec const list{.groups = m, .schedule = BudgetSchedule::list, .list = authors};
  List const lb = budgets(list, equal_groups(32, 8));
  List const authors_list{640, 567, 494, 421, 348, 275, 202, 129};
  for (Index h = 0; h < 32; ++h)
    CHECK(lb[at(h)] == authors_list[at(h / 4)]);
  CHECK(sum(lb) == 4 * 3076);  // 384.5 per head
}

TEST_CASE("head budgets: the presets of Table 9", "[calibration][budgets]") {
  struct Want {
    char const* name;
    List list;
  };
  std::vector<Want> const all{
      {"authors_384", {640, 567, 494, 421, 348, 275, 202, 129}},
      {"paper_384", {640, 566, 492, 418, 344, 270, 196, 122}},
      {"wide_2", {736, 32}},
      {"narrow_2", {512, 256}},
      {"wide_3", {736, 384, 32}},
      {"narrow_3", {512, 384, 256}},
      {"wide_4", {736, 502, 266, 32}},
      {"narrow_4", {512, 427, 342, 256}},
      {"wide_5", {736, 560, 384, 208, 32}},
      {"narrow_5", {512, 448, 384, 320, 256}},
      {"wide_8", {736, 636, 536, 436, 332, 232, 132, 32}},
  };
  for (Want const& w : all) {
    INFO(w.name);
    Index m = -1;
    Index const* p = kvc::head_budget_preset(w.name, m);
    REQUIRE(p != nullptr);
    REQUIRE(m == static_cast<Index>(w.list.size()));
    CHECK(List(p, p + m) == w.list);
    if (std::string(w.name).rfind("wide", 0) == 0 || w.name == std::string("narrow_2") ||
        w.name == std::string("narrow_3") || w.name == std::string("narrow_5"))
      CHECK(sum(w.list) == 384 * m);  // Table 9's lists keep 384 per head on average
  }
  Index m = 7;
  CHECK(kvc::head_budget_preset("narrow_8", m) == nullptr);  // elided in the paper
  CHECK(m == 0);
  CHECK(kvc::head_budget_preset("", m) == nullptr);
  CHECK(kvc::head_budget_preset("wide_2 ", m) == nullptr);
}

TEST_CASE("head budgets: M = 1 or Δ = 0 is uniform SnapKV (property 14)", "[calibration][budgets]") {
  for (Index heads : {1, 7, 32}) {
    CHECK(budgets({.average = 384, .groups = 1, .step = 74}, List(at(heads), 0)) == List(at(heads), 384));
    List g(at(heads));
    for (Index h = 0; h < heads; ++h)
      g[at(h)] = h % 8;
    CHECK(budgets({.average = 384, .groups = 8, .step = 0}, g) == List(at(heads), 384));
    CHECK(budgets({.groups = 8, .step = 0, .largest = 300, .schedule = BudgetSchedule::paper}, g) ==
          List(at(heads), 300));
  }
}

TEST_CASE("head budgets: unequal group sizes keep the layer total (hand cases)", "[calibration][budgets]") {
  // Groups [0, 0, 1], B̄ = 100, Δ = 30: c = (1 + 1 + 2)/3 = 4/3, N = (110, 80), total 300.
  CHECK(budgets({.average = 100, .groups = 2, .step = 30}, {0, 0, 1}) == List{110, 110, 80});
  // Groups [0, 1, 1, 1], B̄ = 100, Δ = 3: c = 7/4, N = (102.25, 99.25): floors 102 + 3·99 = 399, one unit left,
  // all remainders 0.25 -> the lower group takes it: [103, 99, 99, 99].
  CHECK(budgets({.average = 100, .groups = 2, .step = 3}, {0, 1, 1, 1}) == List{103, 99, 99, 99});
  // The same with group 0 last: the unit still goes to group 0 (not to head 0), so groups stay uniform.
  CHECK(budgets({.average = 100, .groups = 2, .step = 3}, {1, 1, 1, 0}) == List{99, 99, 99, 103});
  // A fractional B̄ splits one group: 4 · 100.5 = 402 -> floors 400, two units to heads 0 and 1.
  CHECK(budgets({.average = 100.5, .groups = 1, .step = 0}, {0, 0, 0, 0}) == List{101, 101, 100, 100});
  // M = 2, Δ = 75: N = 384 ± 37.5, every remainder 0.5; the 16 units go to the 16 heads of group 0.
  List const b = budgets({.average = 384, .groups = 2, .step = 75}, equal_groups(32, 2));
  CHECK(b == [] {
    List l(32, 346);
    std::fill(l.begin(), l.begin() + 16, 422);
    return l;
  }());
  // group_budgets with the authors' 11/10/11 split of 32 heads: c = (11 + 20 + 33)/32 = 2 -> [484, 384, 284].
  std::vector<double> per(3);
  List const sizes{11, 10, 11};
  REQUIRE(kvc::group_budgets({.average = 384, .groups = 3, .step = 100}, sizes.data(), per.data()).ok());
  CHECK(per == std::vector<double>{484, 384, 284});
  // Sizes [8, 8, 7, 8] (31 heads): c = 77/31, Σ n_g N_g = 31 · 384.
  List const odd{8, 8, 7, 8};
  std::vector<double> per4(4);
  REQUIRE(kvc::group_budgets({.average = 384, .groups = 4, .step = 50}, odd.data(), per4.data()).ok());
  CHECK_THAT(per4[0], WithinAbs(384.0 + (77.0 / 31.0 - 1.0) * 50.0, 1e-9));
  double total = 0.0;
  for (std::size_t g = 0; g < 4; ++g)
    total += static_cast<double>(odd[g]) * per4[g];
  CHECK_THAT(total, WithinAbs(31.0 * 384.0, 1e-9));
}

TEST_CASE("head budgets: conservation, monotone in the group, equal within a group (properties 11, 12)",
          "[calibration][budgets]") {
  kvc::tools::Rng rng(17);
  for (Index heads : {4, 8, 28, 32, 40}) {
    for (Index groups : {1, 2, 3, 5, 8}) {
      for (double average : {384.0, 64.0, 100.3, 384.5}) {
        for (double step : {0.0, 1.0, 7.0, 73.0, 74.5}) {
          if (average - static_cast<double>(groups) * step < 0.0)
            continue;  // would need a negative budget
          // Balanced groups from random entropies, and an arbitrary assignment.
          std::vector<double> e(at(heads));
          for (double& x : e)
            x = rng.uniform();
          List balanced(at(heads)), arbitrary(at(heads));
          REQUIRE(kvc::group_heads(e.data(), heads, groups, balanced.data()).ok());
          for (Index& g : arbitrary)
            g = static_cast<Index>(rng.next() % static_cast<std::uint64_t>(groups));
          for (List const* g : {&balanced, &arbitrary}) {
            HeadBudgetSpec const spec{.average = average, .groups = groups, .step = step};
            List const b = budgets(spec, *g);
            CHECK(sum(b) == static_cast<Index>(std::llround(static_cast<double>(heads) * average)));  // property 12
            for (Index x = 0; x < heads; ++x)
              for (Index y = 0; y < heads; ++y) {
                Index const gx = (*g)[at(x)], gy = (*g)[at(y)];
                if (gx == gy)
                  CHECK(std::abs(b[at(x)] - b[at(y)]) <= 1);
                if (gx < gy && step >= 1.0)
                  CHECK(b[at(x)] >= b[at(y)]);
                // Integer group budgets (integer B̄; equal sizes, so c = (M + 1)/2, and (c − g)Δ integral: Δ integral
                // for M odd, even for M even): equal within a group, and monotone in entropy (property 11).
                bool const integral = average == std::floor(average) && g == &balanced && heads % groups == 0 &&
                                      std::fmod(step * (groups % 2 == 1 ? 1.0 : 0.5), 1.0) == 0.0;
                if (integral && gx == gy)
                  CHECK(b[at(x)] == b[at(y)]);
                if (integral && e[at(x)] > e[at(y)])
                  CHECK(b[at(x)] >= b[at(y)]);
              }
          }
        }
      }
    }
  }
}

TEST_CASE("head budgets: clamped to min_tokens (property 15)", "[calibration][budgets]") {
  // B̄ = 20, M = 4, Δ = 10: [35, 25, 15, 5]; w = 8 raises the last group to 8 (the total then exceeds H·B̄).
  List const g{0, 1, 2, 3};
  CHECK(budgets({.average = 20, .groups = 4, .step = 10}, g, 0) == List{35, 25, 15, 5});
  CHECK(budgets({.average = 20, .groups = 4, .step = 10}, g, 8) == List{35, 25, 15, 8});
  CHECK(budgets({.average = 20, .groups = 4, .step = 10}, g, 40) == List{40, 40, 40, 40});
  List const b = budgets({.average = 384, .groups = 8, .step = 74}, equal_groups(32, 8), 8);
  CHECK(*std::min_element(b.begin(), b.end()) == 125);  // above w: no change
}

TEST_CASE("head budgets: bad specs and arguments are errors", "[calibration][budgets]") {
  List const g{0, 1, 1, 0};
  List b(4);
  auto code = [&](HeadBudgetSpec const& s, Index min_tokens = 0) {
    return kvc::head_budgets(s, g.data(), 4, min_tokens, b.data()).code();
  };
  double const nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(code({.groups = 0}) == kvc::Errc::invalid_argument);
  CHECK(code({.groups = 2, .step = -1}) == kvc::Errc::invalid_argument);
  CHECK(code({.groups = 2, .step = nan}) == kvc::Errc::invalid_argument);
  CHECK(code({.average = -1, .groups = 2}) == kvc::Errc::invalid_argument);
  CHECK(code({.average = nan, .groups = 2}) == kvc::Errc::invalid_argument);
  // 100 − 100.5 < 0: real budgets [200.5, −0.5, −0.5, 200.5] round to [201, −1, −1, 201] (ties to the lower group),
  // then clamp to min_tokens
  CHECK(code({.average = 100, .groups = 2, .step = 201}, 3) == kvc::Errc::ok);
  CHECK(b == List{201, 3, 3, 201});
  CHECK(code({.average = 100, .groups = 2, .step = 200}) == kvc::Errc::ok);  // [200, 0]
  CHECK(code({.groups = 8, .step = 20, .largest = 100, .schedule = BudgetSchedule::paper}) ==
        kvc::Errc::invalid_argument);  // 100 − 7 · 20 < 0
  CHECK(code({.groups = 2, .largest = -1, .schedule = BudgetSchedule::paper}) == kvc::Errc::invalid_argument);
  CHECK(code({.groups = 2, .schedule = BudgetSchedule::list}) == kvc::Errc::invalid_argument);  // no list
  Index const negative[] = {5, -1};
  CHECK(code({.groups = 2, .schedule = BudgetSchedule::list, .list = negative}) == kvc::Errc::invalid_argument);
  CHECK(code({.groups = 1}) == kvc::Errc::invalid_argument);  // group 1 is out of [0, 1)
  CHECK(code({.groups = 2}, -1) == kvc::Errc::invalid_argument);
  CHECK(kvc::head_budgets({.groups = 2}, g.data(), 0, 0, b.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::head_budgets({.groups = 2}, nullptr, 4, 0, b.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::head_budgets({.groups = 2}, g.data(), 4, 0, nullptr).code() == kvc::Errc::invalid_argument);
  std::vector<double> per(2);
  List const sizes{2, -1}, empty{0, 0};
  CHECK(kvc::group_budgets({.groups = 2}, sizes.data(), per.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::group_budgets({.groups = 2}, empty.data(), per.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::group_budgets({.groups = 2}, nullptr, nullptr).code() == kvc::Errc::invalid_argument);
  CHECK(std::string(HeadBudgetSpec{.groups = 0}.check().message()).find("groups") != std::string::npos);
}
