// SPDX-License-Identifier: Apache-2.0
// tests/pipeline/layer_stages_test.cpp mirrors include/kvc/pipeline/layer_stages.hpp: UNComp's layer stages and
// hidden-state pruning (shared/specs/uncomp.md §2.9, §7.8-7.14 and §8 properties 16-18). The authors' shipped layer
// curves are not in the spec, so curves are built by hand with drops at the layers that start the spec's 32- and
// 40-layer partitions; the token counts for Llama2/Llama3 are the spec's; the selections are worked out by hand or
// compared with a brute-force sort.
#include <kvc/pipeline/layer_stages.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <set>
#include <string>
#include <vector>

namespace {

using kvc::Index;
using List = std::vector<Index>;

std::size_t at(Index i) {
  return static_cast<std::size_t>(i);
}

List partition(std::vector<double> const& s, double epsilon, Index* stages = nullptr) {
  List out(s.size());
  Index count = -1;
  REQUIRE(kvc::partition_layers(s.data(), static_cast<Index>(s.size()), epsilon, out.data(), count).ok());
  REQUIRE(count == out.back() + 1);
  if (stages)
    *stages = count;
  return out;
}

List partition_count(std::vector<double> const& s, Index stages) {
  List out(s.size());
  REQUIRE(kvc::partition_layers_count(s.data(), static_cast<Index>(s.size()), stages, out.data()).ok());
  return out;
}

List counts(Index n, Index stages, Index min_tokens, Index step) {
  List out(at(stages));
  REQUIRE(kvc::hidden_state_counts(n, stages, min_tokens, step, out.data()).ok());
  return out;
}

List select(std::vector<float> const& scores, Index keep, Index window) {
  Index const n = static_cast<Index>(scores.size());
  List out(at(std::max<Index>(1, std::min(n, std::max(keep, window)))), -7);
  Index kept = -1;
  REQUIRE(kvc::select_hidden_states(scores.data(), n, keep, window, out.data(), kept).ok());
  REQUIRE(kept >= 0);
  REQUIRE(kept <= static_cast<Index>(out.size()));
  out.resize(at(kept));
  return out;
}

/// Stages from the list of first layers of each stage (0 first), e.g. {0, 2, 15} over 20 layers.
List stages_from_starts(Index layers, List const& starts) {
  List out(at(layers));
  Index stage = -1;
  for (Index l = 0; l < layers; ++l) {
    if (std::find(starts.begin(), starts.end(), l) != starts.end())
      ++stage;
    out[at(l)] = stage;
  }
  return out;
}

/// A falling curve of `layers` layers: small moves in [−0.5, +0.9) (drops below 1) except a drop of 1.2 to 3 at each
/// layer of `starts` (after 0), so ε = 1 separates them.
std::vector<double> curve(Index layers, List const& starts, std::uint64_t seed) {
  kvc::tools::Rng rng(seed);
  std::vector<double> s(at(layers));
  s[0] = 90.0;
  for (Index l = 1; l < layers; ++l) {
    bool const start = std::find(starts.begin(), starts.end(), l) != starts.end();
    double const drop = start ? 1.2 + 1.8 * rng.uniform() : -0.5 + 1.4 * rng.uniform();
    s[at(l)] = s[at(l - 1)] - drop;
  }
  return s;
}

}  // namespace

TEST_CASE("layer stages: a drop above epsilon starts a stage (hand curve)", "[pipeline][stages]") {
  // Drops: l1 0.2, l2 1.3, l3 0.1, l4 0.1, l5 2.3, l6 0.1, l7 −0.05 (a rise), l8 1.95.
  std::vector<double> const s{10, 9.8, 8.5, 8.4, 8.3, 6.0, 5.9, 5.95, 4.0};
  Index stages = 0;
  CHECK(partition(s, 1.0, &stages) == List{0, 0, 1, 1, 1, 2, 2, 2, 3});
  CHECK(stages == 4);
  CHECK(partition(s, 0.15, &stages) == List{0, 1, 2, 2, 2, 3, 3, 3, 4});
  CHECK(partition(s, 2.0, &stages) == List{0, 0, 0, 0, 0, 1, 1, 1, 1});
  CHECK(partition(s, std::numeric_limits<double>::infinity(), &stages) == List(9, 0));
  CHECK(stages == 1);
  CHECK(partition(s, 0.0, &stages) == List{0, 1, 2, 3, 4, 5, 6, 6, 7});  // every drop but the rise at l7
  // Strictly greater: exact drops 1, 2, 0.5 with ε = 1 split only at the drop of 2.
  CHECK(partition({4, 3, 1, 0.5}, 1.0) == List{0, 0, 1, 1});
  CHECK(partition({4, 3, 1, 0.5}, 0.5) == List{0, 1, 2, 2});
  // A rising curve (Alg. 2's sign) never splits.
  CHECK(partition({1, 3, 6, 10}, 0.5) == List{0, 0, 0, 0});
  CHECK(partition({5}, 0.1) == List{0});
}

TEST_CASE("layer stages: curves shaped like the authors' reproduce their 32- and 40-layer partitions (property 16)",
          "[pipeline][stages]") {
  // 32 layers: {0,1} {2..14} {15..25} {26..30} {31}.
  List const starts32{0, 2, 15, 26, 31};
  // 40 layers: {0} {1,2} {3..14} {15..22} {23..30} {31..34} {35,36} {37..39}.
  List const starts40{0, 1, 3, 15, 23, 31, 35, 37};
  for (std::uint64_t seed = 1; seed <= 20; ++seed) {
    Index stages = 0;
    CHECK(partition(curve(32, starts32, seed), 1.0, &stages) == stages_from_starts(32, starts32));
    CHECK(stages == 5);
    CHECK(partition(curve(40, starts40, seed), 1.0, &stages) == stages_from_starts(40, starts40));
    CHECK(stages == 8);
    // The target-count form picks the same drops: they are the largest.
    CHECK(partition_count(curve(32, starts32, seed), 5) == stages_from_starts(32, starts32));
    CHECK(partition_count(curve(40, starts40, seed), 8) == stages_from_starts(40, starts40));
  }
}

TEST_CASE("layer stages: 1 + #drops stages, contiguous, non-increasing in epsilon (property 16)",
          "[pipeline][stages]") {
  kvc::tools::Rng rng(23);
  for (Index layers : {1, 2, 7, 32, 40}) {
    std::vector<double> s(at(layers));
    for (double& x : s)
      x = 80.0 * rng.uniform();
    std::vector<double> eps{0.0, std::numeric_limits<double>::infinity()};
    for (Index l = 1; l < layers; ++l)
      eps.push_back(std::abs(s[at(l - 1)] - s[at(l)]) * 0.999);
    std::sort(eps.begin(), eps.end());
    Index previous = std::numeric_limits<Index>::max();
    for (double e : eps) {
      Index stages = 0;
      List const p = partition(s, e, &stages);
      Index drops = 0;
      for (Index l = 1; l < layers; ++l)
        drops += s[at(l - 1)] - s[at(l)] > e ? 1 : 0;
      CHECK(stages == 1 + drops);
      CHECK(p[0] == 0);
      for (Index l = 1; l < layers; ++l)
        CHECK((p[at(l)] == p[at(l - 1)] || p[at(l)] == p[at(l - 1)] + 1));
      CHECK(stages <= previous);
      previous = stages;
    }
    CHECK(previous == 1);  // ε = +inf
  }
}

TEST_CASE("layer stages: a target count takes the largest drops, ties to the lower layer", "[pipeline][stages]") {
  std::vector<double> const s{10, 9.8, 8.5, 8.4, 8.3, 6.0, 5.9, 5.95, 4.0};
  CHECK(partition_count(s, 1) == List(9, 0));
  CHECK(partition_count(s, 2) == List{0, 0, 0, 0, 0, 1, 1, 1, 1});  // l5 (2.3)
  CHECK(partition_count(s, 3) == List{0, 0, 0, 0, 0, 1, 1, 1, 2});  // + l8 (1.95)
  CHECK(partition_count(s, 4) == List{0, 0, 1, 1, 1, 2, 2, 2, 3});  // + l2 (1.3)
  CHECK(partition_count(s, 9) == List{0, 1, 2, 3, 4, 5, 6, 7, 8});  // every layer, the rise included
  CHECK(partition_count({3, 2, 1, 0}, 2) == List{0, 1, 1, 1});      // equal drops: the lowest layer first
  CHECK(partition_count({3, 2, 1, 0}, 3) == List{0, 1, 2, 2});
  // Against partition_layers: with distinct drops, C stages = ε between the C-th and (C−1)-th largest drop.
  kvc::tools::Rng rng(29);
  for (int trial = 0; trial < 20; ++trial) {
    Index const layers = 32;
    std::vector<double> c(at(layers));
    for (double& x : c)
      x = 200.0 - 4.0 * static_cast<double>(&x - c.data()) + 3.0 * rng.uniform();  // drops in (1, 7)
    std::vector<double> drops;
    for (Index l = 1; l < layers; ++l)
      drops.push_back(c[at(l - 1)] - c[at(l)]);
    std::sort(drops.rbegin(), drops.rend());
    for (Index stages = 2; stages < layers; ++stages) {
      double const e = 0.5 * (drops[at(stages - 2)] + drops[at(stages - 1)]);
      Index got = 0;
      CHECK(partition_count(c, stages) == partition(c, e, &got));
      CHECK(got == stages);
    }
  }
}

TEST_CASE("layer stages: bad arguments are errors", "[pipeline][stages]") {
  std::vector<double> s{3, 2, 1};
  List out(3);
  Index stages = 0;
  CHECK(kvc::partition_layers(s.data(), 0, 1.0, out.data(), stages).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::partition_layers(s.data(), 3, -0.1, out.data(), stages).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::partition_layers(s.data(), 3, std::nan(""), out.data(), stages).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::partition_layers(nullptr, 3, 1.0, out.data(), stages).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::partition_layers(s.data(), 3, 1.0, nullptr, stages).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::partition_layers_count(s.data(), 3, 0, out.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::partition_layers_count(s.data(), 3, 4, out.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::partition_layers_count(nullptr, 3, 2, out.data()).code() == kvc::Errc::invalid_argument);
  s[1] = std::numeric_limits<double>::quiet_NaN();
  CHECK(kvc::partition_layers(s.data(), 3, 1.0, out.data(), stages).code() == kvc::Errc::non_finite);
  CHECK(kvc::partition_layers_count(s.data(), 3, 2, out.data()).code() == kvc::Errc::non_finite);
  CHECK(std::string(kvc::partition_layers(s.data(), 3, -1.0, out.data(), stages).message()).find("epsilon") !=
        std::string::npos);
}

TEST_CASE("hidden states: counts per stage (spec §2.9 and §7.13, property 17)", "[pipeline][stages]") {
  // The code's step ⌊(n − 1536)/(C − 1)⌋: Llama2 (4096, C = 5) and Llama3 (8192, C = 5), from the spec.
  CHECK(counts(4096, 5, 1536, 0) == List{4096, 3456, 2816, 2176, 1536});
  CHECK(counts(8192, 5, 1536, 0) == List{8192, 6528, 4864, 3200, 1536});
  // C = 8 at 4096: step 365, from n down (the spec's rec; the authors' code starts at 1536 + 7·365 = 4091).
  CHECK(counts(4096, 8, 1536, -1) == List{4096, 3731, 3366, 3001, 2636, 2271, 1906, 1541});
  // The paper's Δn = 512, floored at 1536.
  CHECK(counts(4096, 5, 1536, 512) == List{4096, 3584, 3072, 2560, 2048});
  CHECK(counts(3000, 5, 1536, 512) == List{3000, 2488, 1976, 1536, 1536});
  // No pruning at or below the floor.
  CHECK(counts(1536, 5, 1536, 0) == List(5, 1536));
  CHECK(counts(1000, 5, 1536, 512) == List(5, 1000));
  CHECK(counts(1537, 5, 1536, 0) == List(5, 1537));  // default step ⌊1/4⌋ = 0
  CHECK(counts(777, 1, 100, 0) == List{777});
  CHECK(counts(0, 3, 0, 0) == List{0, 0, 0});
  CHECK(counts(10, 3, 2, std::numeric_limits<Index>::max()) == List{10, 2, 2});  // no overflow
  for (Index n : {0, 1, 8, 100, 1536, 1537, 4096, 8191}) {
    for (Index stages : {1, 2, 5, 8}) {
      for (Index step : {0, 1, 100, 512}) {
        List const k = counts(n, stages, 1536, step);
        CHECK(k[0] == n);
        for (Index c = 1; c < stages; ++c) {
          CHECK(k[at(c)] <= k[at(c - 1)]);
          CHECK(k[at(c)] >= std::min<Index>(n, 1536));
        }
      }
    }
  }
  List out(2);
  CHECK(kvc::hidden_state_counts(-1, 2, 0, 0, out.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::hidden_state_counts(5, 0, 0, 0, out.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::hidden_state_counts(5, 2, -1, 0, out.data()).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::hidden_state_counts(5, 2, 0, 0, nullptr).code() == kvc::Errc::invalid_argument);
}

TEST_CASE("hidden states: top scores plus the forced window, ascending (hand cases)", "[pipeline][stages]") {
  std::vector<float> const u{0.1f, 0.9f, 0.3f, 0.9f, 0.05f, 0.2f, 0.7f, 0.0f};
  CHECK(select(u, 4, 2) == List{1, 3, 6, 7});     // window 6, 7; the two 0.9s of the prefix
  CHECK(select(u, 3, 2) == List{1, 6, 7});        // the 0.9 tie goes to the lower index
  CHECK(select(u, 5, 0) == List{1, 2, 3, 5, 6});  // 0.9, 0.9, 0.7, 0.3, 0.2
  CHECK(select(u, 1, 3) == List{5, 6, 7});        // the window outranks `keep`
  CHECK(select(u, 3, 8) == List{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(select(u, 10, 2) == List{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(select(u, 0, 0).empty());
  CHECK(select(u, 2, 20) == List{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(select({}, 4, 2).empty());
  std::vector<float> const inf{-std::numeric_limits<float>::infinity(), 1.0f, std::numeric_limits<float>::infinity(),
                               0.0f};
  CHECK(select(inf, 2, 0) == List{1, 2});
}

TEST_CASE("hidden states: sorted, unique, window kept, top-k by brute force (property 18)", "[pipeline][stages]") {
  kvc::tools::Rng rng(31);
  for (Index n : {1, 2, 9, 64, 333}) {
    std::vector<float> u(at(n));
    for (float& x : u)
      x = static_cast<float>(rng.next() % 7) * 0.25f;  // many ties
    for (Index window : {0, 1, 8}) {
      for (Index keep : List{0, 1, 5, n / 2, n - 1, n, n + 3}) {
        if (keep < 0)
          continue;
        List const got = select(u, keep, window);
        Index const recent = std::min(window, n);
        Index const total = std::max(std::min(keep, n), recent);
        REQUIRE(static_cast<Index>(got.size()) == total);
        CHECK(std::is_sorted(got.begin(), got.end()));
        CHECK(std::adjacent_find(got.begin(), got.end()) == got.end());
        for (Index j = n - recent; j < n; ++j)
          CHECK(std::binary_search(got.begin(), got.end(), j));
        // Brute force: the prefix ranked by (score desc, index asc), the first total − recent of it.
        List order(at(n - recent));
        std::iota(order.begin(), order.end(), Index{0});
        std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) { return u[at(a)] > u[at(b)]; });
        List want(order.begin(), order.begin() + (total - recent));
        for (Index j = n - recent; j < n; ++j)
          want.push_back(j);
        std::sort(want.begin(), want.end());
        CHECK(got == want);
      }
    }
  }
}

TEST_CASE("hidden states: two stages keep original positions, the last w at both", "[pipeline][stages]") {
  // Stage 1 keeps rows of the n-token sequence; stage 2 scores the kept rows (in their order) and keeps some of them.
  // The original positions of stage 2 are positions1[kept2]: still ascending, a subset, the last w included.
  Index const n = 100, w = 8;
  kvc::tools::Rng rng(37);
  std::vector<float> u1(at(n));
  for (float& x : u1)
    x = static_cast<float>(rng.uniform());
  List const p1 = select(u1, 60, w);
  std::vector<float> u2(p1.size());
  for (float& x : u2)
    x = static_cast<float>(rng.uniform());
  List const k2 = select(u2, 30, w);
  List p2;
  for (Index i : k2)
    p2.push_back(p1[at(i)]);
  CHECK(p2.size() == 30);
  CHECK(std::is_sorted(p2.begin(), p2.end()));
  CHECK(std::includes(p1.begin(), p1.end(), p2.begin(), p2.end()));
  for (Index j = n - w; j < n; ++j)
    CHECK(std::binary_search(p2.begin(), p2.end(), j));
}

TEST_CASE("hidden states: bad arguments are errors", "[pipeline][stages]") {
  std::vector<float> u{0.1f, 0.2f, 0.3f};
  List out(3);
  Index kept = 0;
  CHECK(kvc::select_hidden_states(u.data(), -1, 1, 0, out.data(), kept).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::select_hidden_states(u.data(), 3, -1, 0, out.data(), kept).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::select_hidden_states(u.data(), 3, 1, -1, out.data(), kept).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::select_hidden_states(nullptr, 3, 1, 0, out.data(), kept).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::select_hidden_states(u.data(), 3, 1, 0, nullptr, kept).code() == kvc::Errc::invalid_argument);
  u[1] = std::numeric_limits<float>::quiet_NaN();
  CHECK(kvc::select_hidden_states(u.data(), 3, 1, 0, out.data(), kept).code() == kvc::Errc::non_finite);
  CHECK(kvc::select_hidden_states(static_cast<float const*>(nullptr), 0, 1, 0, nullptr, kept).ok());
  CHECK(kept == 0);
}
