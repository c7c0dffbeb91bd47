// SPDX-License-Identifier: Apache-2.0
// tests/attention/attend_test.cpp mirrors include/kvc/attention/attend.hpp (CPU attention kernel).
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cmath>
#include <limits>
#include <vector>

using Catch::Matchers::WithinAbs;
using kvc::Index;

namespace {
template <class T>
kvc::AttendQueries<T> queries_of(std::vector<T> const& q, kvc::KVExtents e, Index const* positions = nullptr) {
  return {kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(e)), positions};
}
}  // namespace

TEST_CASE("attend: hand-computed softmax attention and log-sum-exp", "[attention]") {
  // One head, d = 2, keys (1,0), (0,1); query (ln 3 * sqrt 2, 0) -> logits (ln 3, 0) -> weights (3/4, 1/4).
  std::vector<float> k = {1, 0, 0, 1}, v = {4, 0, 0, 8};
  auto const cache = kvc::dense_cache(k.data(), v.data(), {1, 1, 2, 2});
  std::vector<float> q = {static_cast<float>(std::log(3.0) * std::sqrt(2.0)), 0};
  auto const queries = queries_of(q, {1, 1, 1, 2});
  std::vector<float> out(2), lse(1);
  kvc::Attention const op{.causal = false};
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, op, queries, cache));
  REQUIRE(kvc::attend(kvc::Cpu{}, op, queries, cache, {out.data(), lse.data()}, ws.get()).ok());
  CHECK_THAT(out[0], WithinAbs(3.0, 1e-6));
  CHECK_THAT(out[1], WithinAbs(2.0, 1e-6));
  CHECK_THAT(lse[0], WithinAbs(std::log(4.0), 1e-6));  // log(e^{ln 3} + e^0)
  // fp16 queries of the same values give the same weights within fp16 rounding.
  std::vector<kvc::half> qh = {kvc::half(q[0]), kvc::half(0.0f)};
  REQUIRE(kvc::attend(kvc::Cpu{}, op, queries_of(qh, {1, 1, 1, 2}), cache, {out.data(), lse.data()}, ws.get()).ok());
  CHECK_THAT(out[0], WithinAbs(3.0, 2e-3));
}

TEST_CASE("attend: the causal mask reads query and cache positions, GQA maps consecutive query heads", "[attention]") {
  auto c = kvc::tools::HostCache<float>::random({1, 2, 5, 4}, 3);
  std::vector<float> q(static_cast<std::size_t>(1 * 4 * 2 * 4), 0.0f);  // 4 query heads, 2 queries, zero queries
  std::vector<Index> positions = {1, 2};  // query 0 sees keys 0..1, query 1 sees keys 0..2; uniform weights
  auto const queries = queries_of(q, {1, 4, 2, 4}, positions.data());
  std::vector<float> out(static_cast<std::size_t>(4 * 2 * 4)), lse(8);
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, queries, c.view()));
  REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, c.view(), {out.data(), lse.data()}, ws.get()).ok());
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
  // Cache positions: head 1's slots hold positions {0, 3, 4, 7, 9}; a query at position 3 sees its first 2 slots.
  c.positions = {0, 1, 2, 3, 4, 0, 3, 4, 7, 9};
  positions = {3, 3};
  REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, c.view(), {out.data(), lse.data()}, ws.get()).ok());
  CHECK_THAT(lse[static_cast<std::size_t>(2 * 2)], WithinAbs(std::log(2.0), 1e-6));  // query head 2 reads head 1
  CHECK_THAT(lse[0], WithinAbs(std::log(4.0), 1e-6));
  // Without query positions, queries are the context's last: positions 8 and 9 (one past the largest is 10).
  auto const last = queries_of(q, {1, 4, 2, 4});
  REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, last, c.view(), {out.data(), lse.data()}, ws.get()).ok());
  CHECK_THAT(lse[static_cast<std::size_t>(2 * 2)], WithinAbs(std::log(4.0), 1e-6));  // sees 0, 3, 4, 7
  CHECK_THAT(lse[static_cast<std::size_t>(2 * 2 + 1)], WithinAbs(std::log(5.0), 1e-6));
}

TEST_CASE("attend: compaction keeps positions, so a compressed cache that kept everything is exact", "[attention]") {
  auto c = kvc::tools::HostCache<float>::random({1, 2, 6, 4}, 5);
  c.track(6);
  auto const full = c;
  auto qs = kvc::tools::HostCache<float>::random({1, 2, 3, 4}, 6);
  auto const queries = queries_of(qs.k, qs.ext);
  double err = -1;
  REQUIRE(kvc::attention_error(queries, full.view(), c.view(), err).ok());
  CHECK(err == 0.0);
  // Head 0 keeps {0, 2, 5}, head 1 keeps everything: a per-head table records the new lengths.
  kvc::test::OwnedPlan plan(1, 2, 6);
  plan.count = {3, 6};
  plan.index = {0, 2, 5, -1, -1, -1, 0, 1, 2, 3, 4, 5};
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, c.view()).ok());
  CHECK(c.lengths == std::vector<Index>{3, 6});
  CHECK(std::vector<Index>(c.positions.begin(), c.positions.begin() + 3) == std::vector<Index>{0, 2, 5});
  REQUIRE(kvc::attention_error(queries, full.view(), c.view(), err).ok());
  CHECK(err > 1e-3);
  // Query 0 (position 3) sees slots at positions <= 3 of head 0: {0, 2}; bit-identical threads change nothing.
  kvc::ThreadPool pool(2);
  std::vector<float> a(static_cast<std::size_t>(2 * 3 * 4)), b(a.size());
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(pool.cpu(), kvc::Attention{}, queries, c.view()));
  REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, c.view(), {a.data()}, ws.get()).ok());
  REQUIRE(kvc::attend(pool.cpu(), kvc::Attention{}, queries, c.view(), {b.data()}, ws.get()).ok());
  CHECK(a == b);
}

TEST_CASE("attend: an empty head yields zeros and lse = -inf, bad shapes are errors", "[attention]") {
  std::vector<float> k(8), v(8), q(4, 1.0f), out(4), lse(1);
  std::vector<Index> lengths = {0};
  auto const cache = kvc::dense_cache(k.data(), v.data(), {1, 1, 2, 4}, lengths.data());
  auto const queries = queries_of(q, {1, 1, 1, 4});
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, queries, cache));
  REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, cache, {out.data(), lse.data()}, ws.get()).ok());
  CHECK(out == std::vector<float>(4, 0.0f));
  CHECK(lse[0] == -std::numeric_limits<float>::infinity());
  CHECK(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries_of(q, {1, 1, 1, 3}), cache, {out.data()}, ws.get()).code() ==
        kvc::Errc::invalid_argument);
  std::vector<float> k2(16), v2(16);
  auto const two_heads = kvc::dense_cache(k2.data(), v2.data(), {1, 2, 2, 4});
  CHECK(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries_of(q, {1, 3, 1, 4}), two_heads, {out.data()}, ws.get())
            .code() == kvc::Errc::invalid_argument);  // 3 query heads over 2 KV heads
  CHECK(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, cache, {out.data()}, {}).code() ==
        kvc::Errc::out_of_capacity);
  lengths[0] = 3;  // past the capacity of 2
  CHECK(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, cache, {out.data()}, ws.get()).code() ==
        kvc::Errc::invalid_argument);
}
