// SPDX-License-Identifier: Apache-2.0
// tests/calibration/head_groups_test.cpp mirrors include/kvc/calibration/head_groups.hpp: UNComp's offline head
// grouping (shared/specs/uncomp.md §2.5, §7.5, §7.15, §7.16 and §8 property 10). Expected groups and sizes are worked
// out by hand in the comments; the authors' hard-coded sizes (11/10/11 and 7/6/6/6/7 for 32 heads) come from §2.5.
#include <kvc/calibration/head_groups.hpp>
#include <kvc/calibration/matrix_entropy.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace {

using Catch::Matchers::WithinRel;
using kvc::Index;
using Groups = std::vector<Index>;

std::size_t at(Index i) {
  return static_cast<std::size_t>(i);
}

Groups sizes(Index heads, Index groups) {
  Groups s(at(groups));
  REQUIRE(kvc::balanced_group_sizes(heads, groups, s.data()).ok());
  return s;
}

Groups grouped(std::vector<double> const& e, Index groups) {
  Groups g(e.size());
  REQUIRE(kvc::group_heads(e.data(), static_cast<Index>(e.size()), groups, g.data()).ok());
  return g;
}

Groups voted(Groups const& labels, Index samples, Index heads, Index groups) {
  Groups g(at(heads));
  REQUIRE(kvc::majority_vote_groups(labels.data(), samples, heads, groups, g.data()).ok());
  return g;
}

/// A MatrixEntropy with consistent units for head dim 128: H_k = ln erank, Ĥ_k = H_k / ln 128.
kvc::MatrixEntropy from_erank(double erank) {
  kvc::MatrixEntropy e;
  e.erank = erank;
  e.truncated = std::log(erank);
  e.normalized = e.truncated / std::log(128.0);
  e.k = 32;
  return e;
}

}  // namespace

TEST_CASE("head groups: balanced sizes reproduce the authors' 11/10/11 and 7/6/6/6/7", "[calibration][groups]") {
  CHECK(sizes(32, 3) == Groups{11, 10, 11});
  CHECK(sizes(32, 5) == Groups{7, 6, 6, 6, 7});
  CHECK(sizes(32, 8) == Groups{4, 4, 4, 4, 4, 4, 4, 4});
  CHECK(sizes(32, 2) == Groups{16, 16});
  CHECK(sizes(28, 8) == Groups{4, 4, 3, 3, 3, 3, 4, 4});  // Qwen2.5: q = 3, r = 4 -> the two outer pairs
  CHECK(sizes(31, 3) == Groups{10, 11, 10});              // r = 1, M odd -> the middle group
  CHECK(sizes(33, 5) == Groups{7, 6, 7, 6, 7});           // r = 3: the outer pair, then the middle
  CHECK(sizes(31, 4) == Groups{8, 8, 7, 8});              // r = 3, M even: the outer pair, then group 1
  CHECK(sizes(4, 8) == Groups{1, 1, 0, 0, 0, 0, 1, 1});   // more groups than heads: inner groups empty
  CHECK(sizes(5, 1) == Groups{5});
}

TEST_CASE("head groups: balanced sizes sum to H, differ by <= 1, symmetric unless r odd and M even (property 10)",
          "[calibration][groups]") {
  for (Index heads = 1; heads <= 64; ++heads) {
    for (Index groups = 1; groups <= heads + 3; ++groups) {
      Groups const s = sizes(heads, groups);
      CHECK(std::accumulate(s.begin(), s.end(), Index{0}) == heads);
      auto const [lo, hi] = std::minmax_element(s.begin(), s.end());
      CHECK(*hi - *lo <= 1);
      Index const r = heads % groups;
      if (!(r % 2 == 1 && groups % 2 == 0)) {
        Groups mirrored(s.rbegin(), s.rend());
        CHECK(s == mirrored);
        // Symmetric sizes keep the preserving centre c = Σ n_g (g + 1) / H at (M + 1) / 2.
        Index weighted = 0;
        for (Index g = 0; g < groups; ++g)
          weighted += s[at(g)] * (g + 1);
        CHECK(2 * weighted == heads * (groups + 1));
      }
    }
  }
}

TEST_CASE("head groups: sorted by entropy, highest first, cut into balanced contiguous groups",
          "[calibration][groups]") {
  // Ranking: h1 (0.9), h5 (0.8), h3 (0.7), h0 (0.5), h4 (0.3), h2 (0.1) -> pairs.
  CHECK(grouped({0.5, 0.9, 0.1, 0.7, 0.3, 0.8}, 3) == Groups{1, 0, 2, 1, 2, 0});
  CHECK(grouped({0.5, 0.9, 0.1, 0.7, 0.3, 0.8}, 2) == Groups{1, 0, 1, 0, 1, 0});
  CHECK(grouped({0.5, 0.9, 0.1, 0.7, 0.3, 0.8}, 1) == Groups{0, 0, 0, 0, 0, 0});
  CHECK(grouped({0.5, 0.9, 0.1, 0.7, 0.3, 0.8}, 6) == Groups{3, 0, 5, 2, 4, 1});
  // Ties go to the lower head index (earlier in the ranking).
  CHECK(grouped({1, 1, 1, 1}, 2) == Groups{0, 0, 1, 1});
  CHECK(grouped({0.5, 0.7, 0.5, 0.7}, 2) == Groups{1, 0, 1, 0});
  CHECK(grouped({0.7, 0.5, 0.5, 0.5}, 2) == Groups{0, 0, 1, 1});
  // 7 heads in 3 groups: q = 2, r = 1, M odd -> sizes [2, 3, 2].
  CHECK(grouped({7, 6, 5, 4, 3, 2, 1}, 3) == Groups{0, 0, 1, 1, 1, 2, 2});
}

TEST_CASE("head groups: a function of the ranking only (H, erank, Ĥ give the same groups) (property 10)",
          "[calibration][groups]") {
  kvc::tools::Rng rng(5);
  for (Index heads : {8, 28, 32, 40}) {
    std::vector<double> h(at(heads)), erank(at(heads)), normalized(at(heads));
    for (Index i = 0; i < heads; ++i) {
      h[at(i)] = 0.5 + 2.0 * rng.uniform();
      erank[at(i)] = std::exp(h[at(i)]);
      normalized[at(i)] = h[at(i)] / std::log(128.0);
    }
    for (Index groups : {2, 3, 5, 8}) {
      Groups const g = grouped(h, groups);
      CHECK(grouped(erank, groups) == g);
      CHECK(grouped(normalized, groups) == g);
      // Group counts are the balanced sizes, and every head of group g has entropy >= every head of group g + 1.
      Groups count(at(groups), 0);
      for (Index i = 0; i < heads; ++i)
        ++count[at(g[at(i)])];
      CHECK(count == sizes(heads, groups));
      for (Index a = 0; a < heads; ++a)
        for (Index b = 0; b < heads; ++b)
          if (g[at(a)] < g[at(b)])
            CHECK(h[at(a)] >= h[at(b)]);
    }
  }
}

TEST_CASE("head groups: bad arguments are errors", "[calibration][groups]") {
  std::vector<double> e{0.1, 0.2, 0.3};
  Groups g(3);
  CHECK(kvc::group_heads(e.data(), 0, 2, g.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::group_heads(e.data(), 3, 0, g.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::group_heads(nullptr, 3, 2, g.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::group_heads(e.data(), 3, 2, nullptr).code() == kvc::Errc::invalid_argument);
  e[1] = std::numeric_limits<double>::quiet_NaN();
  CHECK(kvc::group_heads(e.data(), 3, 2, g.data()).code() == kvc::Errc::non_finite);
  Groups s(2);
  CHECK(kvc::balanced_group_sizes(0, 2, s.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::balanced_group_sizes(3, 0, s.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::balanced_group_sizes(3, 2, nullptr).code() == kvc::Errc::invalid_argument);
  CHECK(std::string(kvc::balanced_group_sizes(3, 0, s.data()).message()).find("groups") != std::string::npos);
}

TEST_CASE("head groups: the authors' greedy majority vote (hand cases)", "[calibration][groups]") {
  // 3 samples, 4 heads, M = 2. Votes for label 0: h0 1, h1 2, h2 2, h3 1 -> group 0 = {h1, h2}.
  CHECK(voted({1, 0, 0, 1,  //
               1, 0, 1, 0,  //
               0, 1, 0, 1},
              3, 4, 2) == Groups{1, 0, 0, 1});
  // Votes for 0: h0 2, h1 2, h2 2, h3 0: the tie goes to the lower indices h0, h1.
  CHECK(voted({0, 0, 1, 1,  //
               0, 1, 0, 1,  //
               1, 0, 0, 1},
              3, 4, 2) == Groups{0, 0, 1, 1});
  // Greedy in label order: label 0 first takes h2 (3 votes for 0; h1 has 2), then label 1 the best of the rest for
  // 1: h0 has 2 votes for 1, h1 has 1, so group 1 = {h0} and group 2 = {h1}, although h1 never voted for 2.
  CHECK(voted({1, 1, 0,  //
               1, 0, 0,  //
               2, 0, 0},
              3, 3, 3) == Groups{1, 2, 0});
  // One sample: the vote returns that sample's labels.
  CHECK(voted({2, 0, 1, 1, 0, 2}, 1, 6, 3) == Groups{2, 0, 1, 1, 0, 2});
  // Balanced sizes for M not dividing H: 5 heads, M = 2 -> sizes [3, 2] (r = 1, M even -> group 0).
  CHECK(voted({1, 1, 1, 1, 1}, 1, 5, 2) == Groups{0, 0, 0, 1, 1});
}

TEST_CASE("head groups: the vote agrees with group_heads when every sample ranks alike", "[calibration][groups]") {
  Index const heads = 32, samples = 7, groups = 8;
  kvc::tools::Rng rng(9);
  std::vector<double> base(at(heads));
  for (double& x : base)
    x = rng.uniform();
  Groups labels;
  for (Index s = 0; s < samples; ++s) {
    std::vector<double> e(base);
    for (double& x : e)
      x = 3.0 * x + static_cast<double>(s);  // a monotone transform per sample
    Groups const g = grouped(e, groups);
    labels.insert(labels.end(), g.begin(), g.end());
  }
  CHECK(voted(labels, samples, heads, groups) == grouped(base, groups));
}

TEST_CASE("head groups: vote arguments are checked", "[calibration][groups]") {
  Groups labels{0, 1, 2, 1};
  Groups g(4);
  CHECK(kvc::majority_vote_groups(labels.data(), 1, 4, 2, g.data()).code() == kvc::Errc::invalid_argument);  // 2
  labels[2] = -1;
  CHECK(kvc::majority_vote_groups(labels.data(), 1, 4, 2, g.data()).code() == kvc::Errc::invalid_argument);
  labels[2] = 0;
  CHECK(kvc::majority_vote_groups(labels.data(), 0, 4, 2, g.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::majority_vote_groups(nullptr, 1, 4, 2, g.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::majority_vote_groups(labels.data(), 1, 4, 2, g.data()).ok());
}

TEST_CASE("head groups: GQA reduction is the mean over each KV head's query heads", "[calibration][groups]") {
  std::vector<double> const q{1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<double> kv(4);
  REQUIRE(kvc::reduce_to_kv_heads(q.data(), 8, 2, kv.data()).ok());
  CHECK(kv[0] == 2.5);  // heads 0..3
  CHECK(kv[1] == 6.5);  // heads 4..7
  REQUIRE(kvc::reduce_to_kv_heads(q.data(), 8, 4, kv.data()).ok());
  CHECK(kv == std::vector<double>{1.5, 3.5, 5.5, 7.5});
  REQUIRE(kvc::reduce_to_kv_heads(q.data(), 8, 1, kv.data()).ok());
  CHECK(kv[0] == 4.5);
  CHECK(kvc::reduce_to_kv_heads(q.data(), 8, 3, kv.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::reduce_to_kv_heads(q.data(), 8, 0, kv.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::reduce_to_kv_heads(q.data(), 0, 1, kv.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::reduce_to_kv_heads(nullptr, 8, 2, kv.data()).code() == kvc::Errc::invalid_argument);
}

TEST_CASE("head groups: EntropyCalibration's mean (Eq. 7) and vote can disagree (hand case)", "[calibration][groups]") {
  // Two heads, M = 2. Sample 0: erank (10, 1); samples 1 and 2: (1.5, 2).
  // Mean erank: h0 = 13/3, h1 = 5/3 -> h0 high. Votes for the high label: h0 1, h1 2 -> h1 high.
  kvc::EntropyCalibration cal(3, 2, 2);
  kvc::MatrixEntropy const s0[] = {from_erank(10.0), from_erank(1.0)};
  kvc::MatrixEntropy const s1[] = {from_erank(1.5), from_erank(2.0)};
  REQUIRE(cal.add(2, s0).ok());
  REQUIRE(cal.add(2, s1).ok());
  REQUIRE(cal.add(2, s1).ok());
  CHECK(cal.samples(2) == 3);
  CHECK(cal.samples(1) == 0);
  CHECK(cal.samples(7) == 0);
  CHECK_THAT(cal.mean_erank(2, 0), WithinRel(13.0 / 3.0, 1e-15));
  CHECK_THAT(cal.mean_erank(2, 1), WithinRel(5.0 / 3.0, 1e-15));
  CHECK_THAT(cal.mean_truncated(2, 0), WithinRel((std::log(10.0) + 2.0 * std::log(1.5)) / 3.0, 1e-15));
  CHECK_THAT(cal.mean_normalized(2, 1),
             WithinRel((std::log(1.0) + 2.0 * std::log(2.0)) / 3.0 / std::log(128.0), 1e-15));
  Groups g(2);
  REQUIRE(cal.groups(2, false, g.data()).ok());
  CHECK(g == Groups{0, 1});
  REQUIRE(cal.groups(2, true, g.data()).ok());
  CHECK(g == Groups{1, 0});
  // Errors.
  CHECK(cal.groups(1, false, g.data()).code() == kvc::Errc::invalid_argument);  // no sample
  CHECK(cal.groups(3, false, g.data()).code() == kvc::Errc::invalid_argument);
  CHECK(cal.add(3, s0).code() == kvc::Errc::invalid_argument);
  CHECK(cal.add(-1, s0).code() == kvc::Errc::invalid_argument);
  CHECK(cal.add(0, nullptr).code() == kvc::Errc::invalid_argument);
  kvc::MatrixEntropy bad[] = {from_erank(2.0), from_erank(2.0)};
  bad[1].erank = std::numeric_limits<double>::infinity();
  CHECK(cal.add(0, bad).code() == kvc::Errc::non_finite);
  CHECK(cal.samples(0) == 0);  // a failed add adds nothing
  CHECK(std::isnan(cal.mean_erank(2, 5)));
  kvc::EntropyCalibration empty(0, 2, 2);
  CHECK(empty.add(0, s0).code() == kvc::Errc::invalid_argument);
  kvc::EntropyCalibration no_groups(1, 2, 0);
  CHECK(no_groups.add(0, s0).code() == kvc::Errc::invalid_argument);
}
