// SPDX-License-Identifier: Apache-2.0
// tests/scorers/knorm_test.cpp mirrors include/kvc/scorers/knorm.hpp.
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

using Catch::Matchers::WithinAbs;
using kvc::Index;

namespace {

/// One head of n keys whose token t has magnitude scales[t % scales.size()]: scale * u with u a random direction of
/// norm in [0.5, 1.1], so every norm fits in fp32 (3e38 * 1.1 < FLT_MAX) while the fp32 squares may not.
template <class T>
std::vector<T> range_keys(Index n, Index dim, std::vector<double> const& scales, std::uint64_t seed) {
  kvc::tools::Rng rng(seed);
  std::vector<T> k;
  for (Index t = 0; t < n; ++t) {
    std::vector<double> u(static_cast<std::size_t>(dim));
    double sq = 0;
    for (double& x : u) {
      x = rng.normal();
      sq += x * x;
    }
    double const f = (0.5 + 0.6 * rng.uniform()) / std::sqrt(sq) * scales[static_cast<std::size_t>(t) % scales.size()];
    for (double x : u)
      k.push_back(kvc::from_float<T>(static_cast<float>(x * f)));
  }
  return k;
}

/// Knorm scores of one head.
template <class T>
std::vector<float> knorm_scores(std::vector<T> keys, Index dim) {
  Index const n = static_cast<Index>(keys.size()) / dim;
  kvc::KVExtents const e{1, 1, n, dim};
  kvc::test::OwnedScores out(1, 1, n);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::KnormScorer{}, e));
  REQUIRE(kvc::score(kvc::Cpu{}, kvc::KnormScorer{}, kvc::dense_cache(keys.data(), keys.data(), e), out.span, ws.get())
              .ok());
  return out.data;
}

/// The reference: minus the norm of the stored (widened) keys, in long double.
template <class T>
std::vector<double> reference_scores(std::vector<T> const& keys, Index dim) {
  std::vector<double> ref;
  for (std::size_t t = 0; t < keys.size() / static_cast<std::size_t>(dim); ++t) {
    long double sq = 0;
    for (Index i = 0; i < dim; ++i) {
      long double const x = kvc::to_float(keys[t * static_cast<std::size_t>(dim) + static_cast<std::size_t>(i)]);
      sq += x * x;
    }
    ref.push_back(-static_cast<double>(std::sqrt(sq)));
  }
  return ref;
}

/// The budget highest scores (ties: lower index) as ascending indices, by kvc's top-k selector.
std::vector<Index> kvc_keep(std::vector<float> scores, Index budget) {
  Index const n = static_cast<Index>(scores.size());
  kvc::TopKSelector const top{kvc::FixedBudget{budget}};
  kvc::test::OwnedPlan plan(1, 1, n);
  kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, top, 1, 1, n));
  REQUIRE(kvc::select(kvc::Cpu{}, top, kvc::ScoreSpan<>{scores.data(), 1, 1, n}, plan.plan, ws.get()).ok());
  return plan.kept(0, 0);
}

/// The same kept set computed from the reference by sorting; REQUIREs a clear gap at the boundary, so the expected set
/// does not hinge on rounding.
std::vector<Index> reference_keep(std::vector<double> const& ref, Index budget) {
  std::vector<Index> order(ref.size());
  std::iota(order.begin(), order.end(), Index{0});
  std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) { return ref[a] > ref[b]; });
  double const last = ref[order[budget - 1]], next = ref[order[budget]];
  REQUIRE(last - next > 1e-4 * std::abs(last));
  std::vector<Index> kept(order.begin(), order.begin() + budget);
  std::sort(kept.begin(), kept.end());
  return kept;
}

/// Scores within 1e-6 relative of the reference, and every budget keeps the reference's set.
void check_against_reference(std::vector<float> const& s, std::vector<double> const& ref,
                             std::vector<Index> const& budgets) {
  for (std::size_t t = 0; t < ref.size(); ++t) {
    INFO("token " << t << ": kvc " << s[t] << ", reference " << ref[t]);
    CHECK(std::abs(double{s[t]} - ref[t]) <= 1e-6 * std::abs(ref[t]));
  }
  for (Index budget : budgets) {
    INFO("budget " << budget);
    CHECK(kvc_keep(s, budget) == reference_keep(ref, budget));
  }
}

}  // namespace

TEST_CASE("knorm: the fp64 range path both backends share scores minus the norm, and -inf for NaN or Inf keys",
          "[scorers][knorm]") {
  constexpr double inf = std::numeric_limits<double>::infinity();
  CHECK(kvc::knorm_fp64_score(4.0) == -2.0f);
  CHECK(kvc::knorm_fp64_score(1e80) == -std::numeric_limits<float>::infinity());  // a norm of 1e40: past FLT_MAX
  CHECK(kvc::knorm_fp64_score(inf) == -std::numeric_limits<float>::infinity());   // an Inf element
  CHECK(kvc::knorm_fp64_score(std::numeric_limits<double>::quiet_NaN()) == -std::numeric_limits<float>::infinity());
}

TEST_CASE("knorm: scores are minus the L2 norm (hand values)", "[scorers][knorm]") {
  std::vector<float> k = {3, 4, 0, 0, 1, 1, -6, 8};  // norms 5, 0, sqrt2, 10
  kvc::KVExtents const e{1, 1, 4, 2};
  kvc::test::OwnedScores out(1, 1, 4);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::KnormScorer{}, e));
  REQUIRE(kvc::score(kvc::Cpu{}, kvc::KnormScorer{}, kvc::dense_cache(k.data(), k.data(), e), out.span, ws.get()).ok());
  CHECK(out.data[0] == -5.0f);
  CHECK(out.data[1] == 0.0f);
  CHECK_THAT(out.data[2], WithinAbs(-std::sqrt(2.0), 1e-6));
  CHECK(out.data[3] == -10.0f);
}

TEST_CASE("knorm: keeps the lowest-norm keys (kvpress test_presses_keep_highest_score)", "[scorers][knorm]") {
  kvc::KVExtents const e{5, 2, 256, 6};  // kvpress: batch 5, 256 tokens
  auto cache = kvc::tools::HostCache<float>::random(e, 3);
  for (double r : {0.0, 0.2, 0.4, 0.6, 0.8}) {
    kvc::Press const press{kvc::KnormScorer{}, kvc::TopKSelector{kvc::RatioBudget{r}}};
    kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
    kvc::test::OwnedPlan plan(5, 2, 256);
    REQUIRE(kvc::compress(kvc::Cpu{}, press, cache.view(), plan.plan, ws.get()).ok());
    for (Index b = 0; b < 5; ++b)
      for (Index h = 0; h < 2; ++h) {
        auto const kept = plan.kept(b, h);
        REQUIRE(static_cast<Index>(kept.size()) == static_cast<Index>(256 * (1.0 - r)));
        // Every kept key has a norm <= every evicted key's norm.
        auto norm = [&](Index t) {
          float s = 0;
          for (Index i = 0; i < 6; ++i)
            s += cache.key(b, h, t)[i] * cache.key(b, h, t)[i];
          return s;
        };
        float max_kept = 0, min_evicted = std::numeric_limits<float>::infinity();
        std::vector<bool> is_kept(256, false);
        for (Index t : kept)
          is_kept[static_cast<std::size_t>(t)] = true;
        for (Index t = 0; t < 256; ++t)
          (is_kept[static_cast<std::size_t>(t)] ? max_kept : min_evicted) =
              is_kept[static_cast<std::size_t>(t)] ? std::max(max_kept, norm(t)) : std::min(min_evicted, norm(t));
        CHECK(max_kept <= min_evicted);
      }
  }
}

TEST_CASE("knorm: fp16 keys are widened exactly", "[scorers][knorm]") {
  std::vector<kvc::half> k = {kvc::half(3.0f), kvc::half(4.0f), kvc::half(0.5f), kvc::half(0.0f)};
  kvc::KVExtents const e{1, 1, 2, 2};
  kvc::test::OwnedScores out(1, 1, 2);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::KnormScorer{}, e));
  REQUIRE(kvc::score(kvc::Cpu{}, kvc::KnormScorer{}, kvc::dense_cache(k.data(), k.data(), e), out.span, ws.get()).ok());
  CHECK(out.data[0] == -5.0f);
  CHECK(out.data[1] == -0.5f);
}

TEST_CASE("knorm: fp32 keys at 1e20, 3e38 and 1e-25 score minus their exact norm", "[scorers][knorm][range]") {
  // Tokens cycle through ordinary keys, 1e20 and 3e38 (the fp32 square overflows) and 1e-25 (it underflows). The
  // lowest norms are kept, so budgets 10, 30, 50 and 70 cut inside the 1e-25, ordinary, 1e20 and 3e38 groups.
  Index const n = 80, dim = 40;  // two 16-lane blocks and a tail
  auto const k = range_keys<float>(n, dim, {1.0, 1e20, 3e38, 1e-25}, 31);
  check_against_reference(knorm_scores(k, dim), reference_scores(k, dim), {10, 30, 50, 70});
}

TEST_CASE("knorm: bf16 keys at 1e30 and 1e-25 score minus their exact norm", "[scorers][knorm][range]") {
  Index const n = 60, dim = 24;
  auto const k = range_keys<kvc::bfloat16>(n, dim, {1e30, 1.0, 1e-25}, 32);
  check_against_reference(knorm_scores(k, dim), reference_scores(k, dim), {10, 30, 50});
}

TEST_CASE("knorm: subnormal keys and a zero key score exactly, a norm past FLT_MAX rounds to -inf",
          "[scorers][knorm][range]") {
  float const tiny = std::numeric_limits<float>::denorm_min();
  float const big = 3e38f;
  std::vector<float> k = {3 * tiny, 4 * tiny, 0, 0, big, big, 4e-39f, 3e-39f};
  auto const s = knorm_scores(k, 2);
  CHECK(s[0] == -5 * tiny);  // 5 * 2^-149, exactly representable
  CHECK(s[1] == 0.0f);
  CHECK(s[2] == -std::numeric_limits<float>::infinity());  // 3e38 * sqrt2 > FLT_MAX: fp32 can only hold -inf
  CHECK_THAT(s[3], WithinAbs(-5e-39, 2 * tiny));
}

TEST_CASE("knorm: a NaN or Inf key scores -inf, its neighbours their norms", "[scorers][knorm]") {
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> k = {3, 4, nan, 0, inf, 1, 0, 0};  // norms 5, NaN, inf, 0
  kvc::KVExtents const e{1, 1, 4, 2};
  kvc::test::OwnedScores out(1, 1, 4);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::KnormScorer{}, e));
  REQUIRE(kvc::score(kvc::Cpu{}, kvc::KnormScorer{}, kvc::dense_cache(k.data(), k.data(), e), out.span, ws.get()).ok());
  CHECK(out.data == std::vector<float>{-5.0f, -inf, -inf, 0.0f});
}
