// SPDX-License-Identifier: Apache-2.0
// tests/scorers/streaming_llm_test.cpp mirrors include/kvc/scorers/streaming_llm.hpp.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/blockwise.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <vector>

using kvc::Index;

namespace {

template <class Budget>
std::vector<Index> kept(Index n, Index n_sink, Budget budget) {
  kvc::KVExtents const e{1, 2, n, 4};
  auto cache = kvc::tools::HostCache<float>::random(e, 1);
  kvc::Press const press{kvc::StreamingLLMScorer{n_sink}, kvc::TopKSelector{budget}};
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
  kvc::test::OwnedPlan plan(1, 2, n);
  REQUIRE(kvc::compress(kvc::Cpu{}, press, cache.view(), plan.plan, ws.get()).ok());
  CHECK(plan.kept(0, 0) == plan.kept(0, 1));  // position-only: every head keeps the same tokens
  return plan.kept(0, 0);
}

}  // namespace

TEST_CASE("streaming_llm: kvpress one-shot, 10 tokens kept 6 with 2 sinks (spec worked example)",
          "[scorers][streaming_llm]") {
  CHECK(kept(10, 2, kvc::FixedBudget{6}) == std::vector<Index>{0, 1, 6, 7, 8, 9});
  CHECK(kept(10, 2, kvc::RatioBudget{0.4}) == std::vector<Index>{0, 1, 6, 7, 8, 9});
}

TEST_CASE("streaming_llm: sinks + recent for every budget, budget below n_sink keeps the first tokens",
          "[scorers][streaming_llm]") {
  CHECK(kept(12, 4, kvc::FixedBudget{6}) == std::vector<Index>{0, 1, 2, 3, 10, 11});
  CHECK(kept(12, 4, kvc::FixedBudget{2}) == std::vector<Index>{0, 1});
  CHECK(kept(12, 0, kvc::FixedBudget{3}) == std::vector<Index>{9, 10, 11});
  CHECK(kept(5, 4, kvc::FixedBudget{9}) == std::vector<Index>{0, 1, 2, 3, 4});
  CHECK(kept(12, 4, kvc::FixedBudget{0}).empty());
}

TEST_CASE("streaming_llm: the kept set is schedule-independent (per-token decode = one shot)",
          "[scorers][streaming_llm]") {
  kvc::KVExtents const e{1, 1, 40, 4};
  auto src = kvc::tools::HostCache<float>::random(e, 2);
  kvc::Press const press{kvc::StreamingLLMScorer{4}, kvc::TopKSelector{kvc::FixedBudget{10}}};
  for (Index block : {1, 3, 7, 40}) {
    Index const cap = kvc::blockwise_capacity(press.selector, block);
    kvc::tools::HostCache<float> work({1, 1, cap, 4});
    work.track(0);
    kvc::test::OwnedWorkspace ws(kvc::blockwise_workspace_bytes(kvc::Cpu{}, press, work.ext));
    REQUIRE(kvc::blockwise_compress(kvc::Cpu{}, press, src.view(), block, work.view(), ws.get()).ok());
    CHECK(work.head_positions(0, 0) == std::vector<Index>{0, 1, 2, 3, 34, 35, 36, 37, 38, 39});
  }
}

TEST_CASE("streaming_llm: rejects negative sinks and caches past 2^24 tokens", "[scorers][streaming_llm]") {
  std::vector<float> none;
  kvc::test::OwnedScores out(1, 1, 3);
  auto const cache = kvc::dense_cache(none.data(), none.data(), {1, 1, 3, 4});
  CHECK(kvc::score(kvc::Cpu{}, kvc::StreamingLLMScorer{-1}, cache, out.span, {}).code() == kvc::Errc::invalid_argument);
  Index const huge = (Index{1} << 24) + 1;
  auto const big = kvc::dense_cache(none.data(), none.data(), {1, 1, huge, 4});
  float dummy = 0;
  CHECK(kvc::score(kvc::Cpu{}, kvc::StreamingLLMScorer{}, big, kvc::ScoreSpan<>{&dummy, 1, 1, huge}, {}).code() ==
        kvc::Errc::invalid_argument);
}
