// SPDX-License-Identifier: Apache-2.0
// tests/attention/attend_test.cpp mirrors include/kvc/attention/attend.hpp (CPU attention kernel).
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>

#include "common/attention_error.hpp"
#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
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
  REQUIRE(kvc::tools::attention_error(queries, full.view(), c.view(), err).ok());
  CHECK(err == 0.0);
  // Head 0 keeps {0, 2, 5}, head 1 keeps everything: a per-head table records the new lengths.
  kvc::test::OwnedPlan plan(1, 2, 6);
  plan.count = {3, 6};
  plan.index = {0, 2, 5, -1, -1, -1, 0, 1, 2, 3, 4, 5};
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, c.view()).ok());
  CHECK(c.lengths == std::vector<Index>{3, 6});
  CHECK(std::vector<Index>(c.positions.begin(), c.positions.begin() + 3) == std::vector<Index>{0, 2, 5});
  REQUIRE(kvc::tools::attention_error(queries, full.view(), c.view(), err).ok());
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

TEST_CASE("attend: an output buffer over the cache's keys or values is refused", "[attention]") {
  // The hand-computed case above: weights (3/4, 1/4) over values (4, 0) and (0, 8). One buffer holds K then V.
  std::vector<float> kv = {1, 0, 0, 1, 4, 0, 0, 8};
  auto const cache = kvc::dense_cache(kv.data(), kv.data() + 4, {1, 1, 2, 2});
  std::vector<float> q = {static_cast<float>(std::log(3.0) * std::sqrt(2.0)), 0};
  auto const queries = queries_of(q, {1, 1, 1, 2});
  kvc::Attention const op{.causal = false};
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, op, queries, cache));
  std::vector<float> const before = kv;
  kvc::Status st = kvc::attend(kvc::Cpu{}, op, queries, cache, {kv.data() + 2}, ws.get());  // over K's second row
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()) == "kvc::attend: `out.out` overlaps the cache's keys or values");
  CHECK(kvc::attend(kvc::Cpu{}, op, queries, cache, {kv.data() + 6}, ws.get()).code() ==
        kvc::Errc::invalid_argument);  // over V
  std::vector<float> out(2);
  CHECK(kvc::attend(kvc::Cpu{}, op, queries, cache, {out.data(), kv.data()}, ws.get()).code() ==
        kvc::Errc::invalid_argument);  // lse over K
  CHECK(kvc::attend(kvc::Cpu{}, op, queries, cache, {q.data()}, ws.get()).code() ==
        kvc::Errc::invalid_argument);  // over the queries
  CHECK(kv == before);
  REQUIRE(kvc::attend(kvc::Cpu{}, op, queries, cache, {out.data()}, ws.get()).ok());
  CHECK_THAT(out[0], WithinAbs(3.0, 1e-6));
  CHECK_THAT(out[1], WithinAbs(2.0, 1e-6));
}

TEST_CASE("attend: a NaN or Inf key skips its slot, the other slots' softmax is unchanged", "[attention]") {
  // Keys (1, 0), bad, (0, 1); the query gives logits (ln 3, bad, 0): weights (3/4, 0, 1/4) over values (4, 0) and
  // (0, 8) -> (3, 2), lse = ln 4, whatever the bad token's value (NaN too: a skipped slot's value never enters).
  float const nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> q = {static_cast<float>(std::log(3.0) * std::sqrt(2.0)), 0};
  auto const queries = queries_of(q, {1, 1, 1, 2});
  kvc::Attention const op{.causal = false};
  for (float const bad : {nan, inf, -inf})
    for (float const bad_value : {nan, 5.0f}) {
      std::vector<float> k = {1, 0, bad, 0, 0, 1}, v = {4, 0, bad_value, bad_value, 0, 8};
      auto const cache = kvc::dense_cache(k.data(), v.data(), {1, 1, 3, 2});
      std::vector<float> out(2), lse(1);
      kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, op, queries, cache));
      REQUIRE(kvc::attend(kvc::Cpu{}, op, queries, cache, {out.data(), lse.data()}, ws.get()).ok());
      CHECK_THAT(out[0], WithinAbs(3.0, 1e-6));
      CHECK_THAT(out[1], WithinAbs(2.0, 1e-6));
      CHECK_THAT(lse[0], WithinAbs(std::log(4.0), 1e-6));
    }
  // A head whose only key is NaN sees no finite slot: zeros and lse = -inf, as an empty head.
  std::vector<float> k = {nan, nan}, v = {nan, nan}, out(2), lse(1);
  auto const lone = kvc::dense_cache(k.data(), v.data(), {1, 1, 1, 2});
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, op, queries, lone));
  REQUIRE(kvc::attend(kvc::Cpu{}, op, queries, lone, {out.data(), lse.data()}, ws.get()).ok());
  CHECK(out == std::vector<float>{0.0f, 0.0f});
  CHECK(lse[0] == -inf);
}

TEST_CASE("attend: a NaN token in a long head changes only its own weight, across tiles and query rows",
          "[attention]") {
  // 200 slots (4 tiles of 64); 2 query heads x 2 causal queries at positions 198 and 199 over one KV head; slot 70's
  // K and V are NaN. The reference is the softmax over the other visible slots (j <= position), in double.
  Index const n = 200, d = 16, bad = 70;
  auto c = kvc::tools::HostCache<float>::random({1, 1, n, d}, 41);
  auto qs = kvc::tools::HostCache<float>::random({1, 2, 2, d}, 42);  // 2 query heads x 2 queries
  for (Index i = 0; i < d; ++i)
    c.k[static_cast<std::size_t>(bad * d + i)] = c.v[static_cast<std::size_t>(bad * d + i)] =
        std::numeric_limits<float>::quiet_NaN();
  std::vector<Index> positions = {198, 199};
  auto const queries = queries_of(qs.k, qs.ext, positions.data());
  std::vector<float> out(static_cast<std::size_t>(2 * 2 * d));
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, queries, c.view()));
  REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, c.view(), {out.data()}, ws.get()).ok());
  double const scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (Index row = 0; row < 4; ++row) {  // (query head, query) rows
    float const* qr = qs.k.data() + row * d;
    Index const seen = positions[static_cast<std::size_t>(row % 2)] + 1;  // slots [0, seen) are visible
    std::vector<double> w(static_cast<std::size_t>(n), 0.0);
    double peak = -1e300, total = 0.0;
    for (Index j = 0; j < seen; ++j)
      if (j != bad) {
        double dot = 0.0;
        for (Index i = 0; i < d; ++i)
          dot += double{qr[i]} * c.k[static_cast<std::size_t>(j * d + i)];
        w[static_cast<std::size_t>(j)] = dot * scale;
        peak = std::max(peak, dot * scale);
      }
    for (Index j = 0; j < seen; ++j)
      if (j != bad)
        total += w[static_cast<std::size_t>(j)] = std::exp(w[static_cast<std::size_t>(j)] - peak);
    for (Index i = 0; i < d; ++i) {
      double want = 0.0;
      for (Index j = 0; j < seen; ++j)
        if (j != bad)
          want += w[static_cast<std::size_t>(j)] / total * c.v[static_cast<std::size_t>(j * d + i)];
      CHECK_THAT(out[static_cast<std::size_t>(row * d + i)], WithinAbs(want, 1e-5));
    }
  }
}

TEST_CASE("attend: V's extents must match K's", "[attention]") {
  // K holds 4 tokens, V only 2: slots 2 and 3 would read V past its buffer.
  std::vector<float> k(4 * 2, 1.0f), v(2 * 2, 2.0f), q(2, 1.0f), out(2);
  auto const cache = kvc::make_cache(kvc::bhtd_rows(k.data(), {1, 1, 4, 2}), kvc::bhtd_rows(v.data(), {1, 1, 2, 2}));
  auto const queries = queries_of(q, {1, 1, 1, 2});
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, queries, cache));
  kvc::Status const st = kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, cache, {out.data()}, ws.get());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()) == "kvc::attend: the cache's values must have its keys' batch, heads and tokens");
}
