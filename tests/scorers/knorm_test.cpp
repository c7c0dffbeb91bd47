// SPDX-License-Identifier: Apache-2.0
// tests/scorers/knorm_test.cpp mirrors include/kvc/scorers/knorm.hpp.
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cmath>
#include <limits>
#include <vector>

using Catch::Matchers::WithinAbs;
using kvc::Index;

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
