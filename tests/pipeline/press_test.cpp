// SPDX-License-Identifier: Apache-2.0
// tests/pipeline/press_test.cpp mirrors include/kvc/pipeline/press.hpp: compress = score + select.
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <string>

using kvc::Index;

TEST_CASE("press: compress equals score followed by select", "[pipeline][press]") {
  kvc::KVExtents const e{2, 4, 100, 16};
  auto c = kvc::tools::HostCache<kvc::bfloat16>::random(e, 77);
  c.lengths = {100, 61};
  kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}, 2, 4}};
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
  kvc::test::OwnedPlan a(2, 4, 100), b(2, 4, 100);
  REQUIRE(kvc::compress(kvc::Cpu{}, press, c.view(), a.plan, ws.get()).ok());

  kvc::test::OwnedScores scores(2, 4, 100);
  kvc::test::OwnedWorkspace sws(kvc::score_workspace_bytes(kvc::Cpu{}, press.scorer, e));
  kvc::test::OwnedWorkspace tws(kvc::select_workspace_bytes(kvc::Cpu{}, press.selector, 2, 4, 100));
  REQUIRE(kvc::score(kvc::Cpu{}, press.scorer, c.view(), scores.span, sws.get()).ok());
  scores.span.lengths = c.lengths.data();
  REQUIRE(kvc::select(kvc::Cpu{}, press.selector, scores.span, b.plan, tws.get()).ok());
  for (Index bb = 0; bb < 2; ++bb)
    for (Index h = 0; h < 4; ++h)
      CHECK(a.kept(bb, h) == b.kept(bb, h));
  CHECK(a.kept(1, 0).size() == 30);  // floor(61 * 0.5)
  CHECK(a.kept(1, 0).back() == 60);  // recent window of the valid tokens
  CHECK(kvc::compress(kvc::Cpu{}, press, c.view(), a.plan, {}).code() == kvc::Errc::out_of_capacity);
}

TEST_CASE("press: compress refuses extents whose rows overflow 64 bits before it carves", "[pipeline][press]") {
  // [2^22, 2^22, 2^22, 1]: batch * heads * tokens = 2^66 rows. Zero strides, so no layout multiplied anything:
  // compress itself must check before it sizes its score tensor.
  Index const big = Index{1} << 22;
  float k = 0.0f;
  kvc::StridedLayout const l{{big, big, big, 1}, 0, 0, 0};
  auto const cache = kvc::make_cache(kvc::TokenRows<float, kvc::StridedLayout>(&k, l),
                                     kvc::TokenRows<float, kvc::StridedLayout>(&k, l));
  kvc::test::OwnedPlan plan(1, 1, 1);
  plan.plan.batch = big;
  plan.plan.heads = big;
  kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}}};
  kvc::Status const st = kvc::compress(kvc::Cpu{}, press, cache, plan.plan, {});
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("kvc::compress: the cache has a negative extent") != std::string::npos);
}
