// SPDX-License-Identifier: Apache-2.0
// tests/support/combinations_test.cpp: the test cases' factor combinations (every one, and the pairwise coverings the
// emulated CUDA parity cases run).
#include "support/combinations.hpp"

#include "support/catch.hpp"

#include <cstddef>
#include <set>
#include <tuple>
#include <vector>

using kvc::test::Combination;

namespace {

/// Whether every pair of values of any two factors appears in some combination (checked pair by pair).
bool covers_every_pair(std::vector<std::size_t> const& sizes, std::vector<Combination> const& cs) {
  std::set<std::tuple<std::size_t, std::size_t, std::size_t, std::size_t>> seen;
  for (Combination const& c : cs) {
    if (c.size() != sizes.size())
      return false;
    for (std::size_t f = 0; f < c.size(); ++f) {
      if (c[f] >= sizes[f])
        return false;
      for (std::size_t g = f + 1; g < c.size(); ++g)
        seen.insert({f, c[f], g, c[g]});
    }
  }
  for (std::size_t f = 0; f < sizes.size(); ++f)
    for (std::size_t g = f + 1; g < sizes.size(); ++g)
      for (std::size_t a = 0; a < sizes[f]; ++a)
        for (std::size_t b = 0; b < sizes[g]; ++b)
          if (!seen.count({f, a, g, b}))
            return false;
  return true;
}

}  // namespace

TEST_CASE("all_combinations: the whole product in row-major order") {
  auto const cs = kvc::test::all_combinations({2, 3});
  REQUIRE(cs == std::vector<Combination>{{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {1, 2}});
  CHECK(kvc::test::all_combinations({}) == std::vector<Combination>{{}});
  CHECK(kvc::test::all_combinations({4}) == std::vector<Combination>{{0}, {1}, {2}, {3}});
  CHECK(kvc::test::all_combinations({2, 2, 4, 10}).size() == 160);
}

TEST_CASE("pairwise_combinations: every pair of values of any two factors, in few combinations") {
  // The emulated parity cases' factors; the minimum is the product of the two largest sizes.
  struct Want {
    std::vector<std::size_t> sizes;
    std::size_t at_most;
  };
  for (auto const& [sizes, at_most] :
       {Want{{2, 2, 4, 10}, 44}, Want{{2, 2, 2, 2, 5}, 12}, Want{{2, 2}, 4}, Want{{3, 1, 3}, 9}, Want{{2, 2, 2}, 4}}) {
    auto const cs = kvc::test::pairwise_combinations(sizes);
    INFO("factors " << sizes.size() << ", combinations " << cs.size());
    CHECK(covers_every_pair(sizes, cs));
    CHECK(cs.size() <= at_most);
    CHECK(cs == kvc::test::pairwise_combinations(sizes));  // deterministic
  }
  // A combination missing one pair is caught by the check itself.
  CHECK_FALSE(covers_every_pair({2, 2}, {{0, 0}, {0, 1}, {1, 0}}));
  // One factor: every value.
  CHECK(kvc::test::pairwise_combinations({3}) == std::vector<Combination>{{0}, {1}, {2}});
}
