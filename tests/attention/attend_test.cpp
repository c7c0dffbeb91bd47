// SPDX-License-Identifier: Apache-2.0
// tests/attention/attend_test.cpp mirrors include/kvc/attention/attend.hpp (CPU reference attention).
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cmath>
#include <limits>
#include <vector>

using Catch::Matchers::WithinAbs;
using kvc::Index;

TEST_CASE("attend: hand-computed softmax attention and log-sum-exp", "[attention]") {
  // One head, d = 2, keys (1,0), (0,1); query (ln 3 * sqrt 2, 0) -> logits (ln 3, 0) -> weights (3/4, 1/4).
  std::vector<float> k = {1, 0, 0, 1}, v = {4, 0, 0, 8};
  auto const cache = kvc::dense_cache(k.data(), v.data(), {1, 1, 2, 2});
  std::vector<float> q = {static_cast<float>(std::log(3.0) * std::sqrt(2.0)), 0};
  kvc::QueryRows const queries(q.data(), kvc::bhtd_layout({1, 1, 1, 2}));
  std::vector<float> out(2), lse(1);
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes({1, 1, 2, 2}, 2));
  REQUIRE(kvc::attend(kvc::Cpu{}, queries, cache, out.data(), lse.data(), {}, nullptr, ws.get()).ok());
  CHECK_THAT(out[0], WithinAbs(3.0, 1e-6));
  CHECK_THAT(out[1], WithinAbs(2.0, 1e-6));
  CHECK_THAT(lse[0], WithinAbs(std::log(4.0), 1e-6));  // log(e^{ln 3} + e^0)
}

TEST_CASE("attend: causal offset masks future keys; GQA maps consecutive query heads", "[attention]") {
  auto c = kvc::tools::HostCache<float>::random({1, 2, 5, 4}, 3);
  std::vector<float> q(static_cast<std::size_t>(1 * 4 * 2 * 4), 0.0f);  // 4 query heads, 2 queries, zero queries
  kvc::QueryRows const queries(q.data(), kvc::bhtd_layout({1, 4, 2, 4}));
  std::vector<float> out(static_cast<std::size_t>(4 * 2 * 4)), lse(8);
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(c.ext, 4));
  // Causal offset 1: query 0 sees keys 0..1, query 1 sees keys 0..2. Zero queries -> uniform weights.
  REQUIRE(
      kvc::attend(kvc::Cpu{}, queries, c.view(), out.data(), lse.data(), {.causal_offset = 1}, nullptr, ws.get()).ok());
  for (Index hq = 0; hq < 4; ++hq) {
    Index const h = hq / 2;
    for (Index i = 0; i < 4; ++i) {
      float const v0 = c.v[static_cast<std::size_t>((h * 5 + 0) * 4 + i)],
                  v1 = c.v[static_cast<std::size_t>((h * 5 + 1) * 4 + i)],
                  v2 = c.v[static_cast<std::size_t>((h * 5 + 2) * 4 + i)];
      CHECK_THAT(out[static_cast<std::size_t>((hq * 2 + 0) * 4 + i)], WithinAbs((v0 + v1) / 2, 1e-6));
      CHECK_THAT(out[static_cast<std::size_t>((hq * 2 + 1) * 4 + i)], WithinAbs((v0 + v1 + v2) / 3, 1e-6));
    }
    CHECK_THAT(lse[static_cast<std::size_t>(hq * 2 + 1)], WithinAbs(std::log(3.0), 1e-6));
  }
}

TEST_CASE("attend: a compacted cache that kept everything reproduces the full cache exactly", "[attention]") {
  auto c = kvc::tools::HostCache<float>::random({1, 2, 6, 4}, 5);
  auto const full = c;
  kvc::test::OwnedPlan plan(1, 2, 6);
  for (Index h = 0; h < 2; ++h) {
    plan.count[static_cast<std::size_t>(h)] = 6;
    for (Index t = 0; t < 6; ++t)
      plan.index[static_cast<std::size_t>(h * 6 + t)] = t;
  }
  auto qs = kvc::tools::HostCache<float>::random({1, 2, 3, 4}, 6);
  kvc::QueryRows const queries(qs.k.data(), kvc::bhtd_layout(qs.ext));
  double err = -1;
  REQUIRE(kvc::attention_error(queries, full.view(), c.view(), plan.plan, err).ok());
  CHECK(err == 0.0);
  // Dropping tokens changes the output; with causal masking, positions come from the plan.
  plan.count = {3, 6};
  plan.index[0] = 0;
  plan.index[1] = 2;
  plan.index[2] = 5;
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, c.view()).ok());
  REQUIRE(kvc::attention_error(queries, full.view(), c.view(), plan.plan, err).ok());
  CHECK(err > 1e-3);
  // Keys kept at positions 0 and 2 only matter for a query at position 2 if 5 is masked.
  REQUIRE(kvc::attention_error(queries, full.view(), c.view(), plan.plan, err, {.causal_offset = 0}).ok());
  CHECK(err > 0.0);
}

TEST_CASE("attend: an empty head yields zeros and lse = -inf; bad shapes are errors", "[attention]") {
  std::vector<float> k(8), v(8), q(4, 1.0f), out(4), lse(1);
  std::vector<Index> lengths = {0};
  auto const cache = kvc::dense_cache(k.data(), v.data(), {1, 1, 2, 4}, -1, lengths.data());
  kvc::QueryRows const queries(q.data(), kvc::bhtd_layout({1, 1, 1, 4}));
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes({1, 1, 2, 4}, 4));
  REQUIRE(kvc::attend(kvc::Cpu{}, queries, cache, out.data(), lse.data(), {}, nullptr, ws.get()).ok());
  CHECK(out == std::vector<float>(4, 0.0f));
  CHECK(lse[0] == -std::numeric_limits<float>::infinity());
  kvc::QueryRows const wrong_dim(q.data(), kvc::bhtd_layout({1, 1, 1, 3}));
  CHECK(kvc::attend(kvc::Cpu{}, wrong_dim, cache, out.data(), nullptr, {}, nullptr, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  std::vector<float> k2(16), v2(16);
  auto const two_heads = kvc::dense_cache(k2.data(), v2.data(), {1, 2, 2, 4});
  kvc::QueryRows const three(q.data(), kvc::bhtd_layout({1, 3, 1, 4}));  // 3 query heads over 2 KV heads
  CHECK(kvc::attend(kvc::Cpu{}, three, two_heads, out.data(), nullptr, {}, nullptr, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::attend(kvc::Cpu{}, queries, cache, out.data(), nullptr, {}, nullptr, {}).code() ==
        kvc::Errc::out_of_capacity);
}
