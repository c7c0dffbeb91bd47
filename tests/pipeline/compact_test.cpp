// SPDX-License-Identifier: Apache-2.0
// tests/pipeline/compact_test.cpp mirrors include/kvc/pipeline/compact.hpp (CPU kernels in backend/cpu/pipeline).
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/core/validate.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cstdint>
#include <string>
#include <vector>

using kvc::Index;

namespace {

/// A plan whose head (b, h) keeps `keep[b * heads + h]`.
kvc::test::OwnedPlan make_plan(Index batch, Index heads, Index capacity, std::vector<std::vector<Index>> const& keep) {
  kvc::test::OwnedPlan p(batch, heads, capacity);
  for (Index bh = 0; bh < batch * heads; ++bh) {
    auto const& k = keep[static_cast<std::size_t>(bh)];
    p.count[static_cast<std::size_t>(bh)] = static_cast<Index>(k.size());
    std::copy(k.begin(), k.end(), p.index.begin() + bh * capacity);
  }
  return p;
}

}  // namespace

TEST_CASE("compact: in place on BHTD moves kept rows to the front, keys and values together", "[pipeline][compact]") {
  kvc::KVExtents const e{1, 2, 6, 3};
  auto c = kvc::tools::HostCache<float>::random(e, 4, 2);  // d_v = 2 != d_k
  auto const before = c;
  auto plan = make_plan(1, 2, 6, {{1, 3, 4}, {0, 5}});
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, c.view()).ok());
  auto row = [](auto const& cache, std::vector<float> const& buf, Index dim, Index h, Index t) {
    return std::vector<float>(buf.begin() + (h * cache.ext.tokens + t) * dim,
                              buf.begin() + (h * cache.ext.tokens + t + 1) * dim);
  };
  CHECK(row(c, c.k, 3, 0, 0) == row(before, before.k, 3, 0, 1));
  CHECK(row(c, c.k, 3, 0, 1) == row(before, before.k, 3, 0, 3));
  CHECK(row(c, c.k, 3, 0, 2) == row(before, before.k, 3, 0, 4));
  CHECK(row(c, c.v, 2, 0, 2) == row(before, before.v, 2, 0, 4));
  CHECK(row(c, c.k, 3, 1, 0) == row(before, before.k, 3, 1, 0));
  CHECK(row(c, c.k, 3, 1, 1) == row(before, before.k, 3, 1, 5));
  CHECK(row(c, c.v, 2, 1, 1) == row(before, before.v, 2, 1, 5));
}

TEST_CASE("compact: in place on BTHD (heads interleaved per token) never overwrites a pending source",
          "[pipeline][compact]") {
  kvc::KVExtents const e{1, 3, 8, 2};
  std::vector<float> k(static_cast<std::size_t>(e.rows() * 2)), v(k.size());
  auto const L = kvc::bthd_layout(e);
  for (Index h = 0; h < 3; ++h)
    for (Index t = 0; t < 8; ++t) {
      k[static_cast<std::size_t>(L.offset(0, h, t))] = static_cast<float>(100 * h + t);
      v[static_cast<std::size_t>(L.offset(0, h, t))] = static_cast<float>(-100 * h - t);
    }
  auto const cache = kvc::make_cache(kvc::TokenRows<float, kvc::StridedLayout>(k.data(), L),
                                     kvc::TokenRows<float, kvc::StridedLayout>(v.data(), L));
  auto plan = make_plan(1, 3, 8, {{1, 2, 3, 7}, {6, 7}, {0, 1, 2, 3, 4, 5, 6, 7}});
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache).ok());
  CHECK(cache.keys.row(0, 0, 3)[0] == 7.0f);
  CHECK(cache.keys.row(0, 1, 0)[0] == 106.0f);
  CHECK(cache.keys.row(0, 1, 1)[0] == 107.0f);
  CHECK(cache.values.row(0, 1, 1)[0] == -107.0f);
  for (Index t = 0; t < 8; ++t)
    CHECK(cache.keys.row(0, 2, t)[0] == static_cast<float>(200 + t));
}

TEST_CASE("compact: a bad plan is rejected before anything moves", "[pipeline][compact]") {
  auto c = kvc::tools::HostCache<float>::random({1, 1, 5, 2}, 1);
  auto const before = c.k;
  for (auto const& bad : std::vector<std::vector<Index>>{{3, 1}, {0, 5}, {-1}, {2, 2}}) {
    auto plan = make_plan(1, 1, 5, {bad});
    CHECK(kvc::compact(kvc::Cpu{}, plan.plan, c.view()).code() == kvc::Errc::invalid_argument);
    CHECK(c.k == before);
  }
  auto plan = make_plan(1, 1, 5, {{0, 1}});
  plan.count[0] = 6;  // more than capacity
  CHECK(kvc::compact(kvc::Cpu{}, plan.plan, c.view()).code() == kvc::Errc::invalid_argument);
}

TEST_CASE("gather: copies kept rows into another buffer, converting element types", "[pipeline][compact]") {
  auto src = kvc::tools::HostCache<float>::random({1, 2, 6, 4}, 8);
  kvc::tools::HostCache<kvc::half> dst({1, 2, 3, 4});
  auto plan = make_plan(1, 2, 6, {{0, 4}, {1, 2, 5}});
  REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, src.view(), dst.view()).ok());
  CHECK(kvc::to_float(dst.key(0, 1, 2)[3]) == kvc::to_float(kvc::half(src.key(0, 1, 5)[3])));
  kvc::tools::HostCache<float> small({1, 2, 2, 4});
  CHECK(kvc::gather(kvc::Cpu{}, plan.plan, src.view(), small.view()).code() == kvc::Errc::out_of_capacity);
}

TEST_CASE("compact: paged cache compacts inside its own pages and reports freed pages", "[pipeline][compact]") {
  kvc::KVExtents const e{2, 2, 12, 2};
  Index const page = 4;
  std::vector<std::int32_t> table = {4, 0, 2, /* seq 1 */ 5, 1, 3};  // 3 pages per sequence, interleaved ids
  auto const layout = kvc::paged_layout(e, page, kvc::PageOrder::hnd, table.data(), 3, 6);
  std::vector<float> kpool(static_cast<std::size_t>(6 * layout.stride_page)), vpool(kpool.size());
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 2; ++h)
      for (Index t = 0; t < 12; ++t) {
        kpool[static_cast<std::size_t>(layout.offset(b, h, t))] = static_cast<float>(1000 * b + 100 * h + t);
        vpool[static_cast<std::size_t>(layout.offset(b, h, t))] = -static_cast<float>(1000 * b + 100 * h + t);
      }
  std::vector<Index> lengths = {12, 12, 10, 10};  // per (sequence, head): heads keep different counts below
  auto const cache = kvc::make_cache(kvc::TokenRows<float, kvc::PagedLayout>(kpool.data(), layout),
                                     kvc::TokenRows<float, kvc::PagedLayout>(vpool.data(), layout),
                                     kvc::head_lengths(lengths.data(), 2));
  REQUIRE(kvc::validate(cache).ok());
  auto plan = make_plan(2, 2, 12, {{0, 5, 9, 11}, {2, 3}, {1, 2, 3, 4, 5}, {9}});
  std::vector<Index> in_use(2);
  auto const r = kvc::page_report(plan.plan, cache, in_use.data());  // before compaction: reads the old lengths
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache).ok());
  CHECK(lengths == std::vector<Index>{4, 2, 5, 1});
  CHECK(cache.keys.row(0, 0, 3)[0] == 11.0f);
  CHECK(cache.values.row(0, 0, 2)[0] == -9.0f);
  CHECK(cache.keys.row(1, 0, 4)[0] == 1005.0f);
  CHECK(cache.keys.row(1, 1, 0)[0] == 1109.0f);
  CHECK(r.pages_before == 6);  // ceil(12/4) + ceil(10/4)
  CHECK(r.pages_after == 3);   // max(4, 2) -> 1 page; max(5, 1) -> 2 pages
  CHECK(r.pages_freed() == 3);
  CHECK(in_use == std::vector<Index>{1, 2});
}

TEST_CASE("compact: a per-sequence table with unequal kept counts is rejected and nothing moves",
          "[pipeline][compact]") {
  auto c = kvc::tools::HostCache<float>::random({2, 2, 6, 2}, 9);
  c.track(6);
  c.per_head = false;
  c.lengths = {6, 5};  // per sequence
  std::vector<float> acc(2 * 2 * 6);
  for (std::size_t i = 0; i < acc.size(); ++i)
    acc[i] = static_cast<float>(i);
  auto const before = c;
  auto const acc_before = acc;
  auto plan = make_plan(2, 2, 6, {{0, 1}, {2, 3}, {1, 2, 4}, {0, 3}});  // sequence 1: heads keep 3 and 2
  CHECK(kvc::compact(kvc::Cpu{}, plan.plan, c.view(), kvc::TokenArray<float>{acc.data(), 2, 2, 6}).code() ==
        kvc::Errc::invalid_argument);
  CHECK(c.k == before.k);
  CHECK(c.v == before.v);
  CHECK(c.positions == before.positions);
  CHECK(c.lengths == before.lengths);
  CHECK(acc == acc_before);
  // Equal counts per sequence are fine: the table records the common count.
  auto ok = make_plan(2, 2, 6, {{0, 1}, {2, 3}, {1, 2, 4}, {0, 3, 4}});
  REQUIRE(kvc::compact(kvc::Cpu{}, ok.plan, c.view(), kvc::TokenArray<float>{acc.data(), 2, 2, 6}).ok());
  CHECK(c.lengths == std::vector<Index>{2, 3});
  // A plan that keeps more than a head's valid length (sequence 1 holds 3 now) is rejected.
  auto too_many = make_plan(2, 2, 6, {{0}, {0}, {0, 1, 2, 3}, {0, 1, 2, 3}});
  CHECK(kvc::compact(kvc::Cpu{}, too_many.plan, c.view()).code() == kvc::Errc::invalid_argument);
}

TEST_CASE("compact: extra per-token arrays and positions move with the rows", "[pipeline][compact]") {
  kvc::KVExtents const e{1, 2, 7, 2};
  auto c = kvc::tools::HostCache<float>::random(e, 10);
  c.track(7);
  c.positions = {0, 2, 3, 5, 8, 9, 11, /**/ 1, 2, 3, 4, 5, 6, 7};
  auto const before = c;
  std::vector<float> acc(14);
  std::vector<std::int32_t> hits(14);
  for (std::size_t i = 0; i < 14; ++i) {
    acc[i] = 0.5f * static_cast<float>(i);
    hits[i] = 100 + static_cast<std::int32_t>(i);
  }
  std::vector<float> wide(2 * 2 * 9, -1.0f);  // an extra array may have more token slots than the cache
  auto plan = make_plan(1, 2, 7, {{1, 4, 6}, {0, 5}});
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, c.view(), kvc::TokenArray<float>{acc.data(), 1, 2, 7},
                       kvc::TokenArray<std::int32_t>{hits.data(), 1, 2, 7},
                       kvc::TokenArray<float>{wide.data(), 1, 2, 9})
              .ok());
  CHECK(c.lengths == std::vector<Index>{3, 2});
  CHECK(c.head_positions(0, 0) == std::vector<Index>{2, 8, 11});
  CHECK(c.head_positions(0, 1) == std::vector<Index>{1, 6});
  CHECK(acc[0] == 0.5f);
  CHECK(acc[1] == 2.0f);
  CHECK(acc[2] == 3.0f);
  CHECK(acc[7] == 3.5f);  // head 1 slot 0 kept in place
  CHECK(acc[8] == 6.0f);  // head 1 slot 1 <- slot 5 (flat 12)
  CHECK(hits[1] == 104);
  CHECK(hits[8] == 112);
  CHECK(c.k[2] == before.k[8]);  // head 0 slot 1 <- slot 4 (dim 2)
  CHECK(c.v[(7 + 1) * 2 + 1] == before.v[(7 + 5) * 2 + 1]);
  // An extra array with fewer slots than the cache is rejected before anything moves.
  auto const frozen = c;
  std::vector<float> narrow(2 * 2 * 6);
  CHECK(kvc::compact(kvc::Cpu{}, plan.plan, c.view(), kvc::TokenArray<float>{narrow.data(), 1, 2, 6}).code() ==
        kvc::Errc::invalid_argument);
  CHECK(c.k == frozen.k);
}

TEST_CASE("gather: writes dst's lengths and positions, and carried arrays", "[pipeline][compact]") {
  kvc::KVExtents const e{1, 2, 6, 2};
  auto src = kvc::tools::HostCache<float>::random(e, 11);
  src.track(6);
  src.lengths = {6, 4};
  src.positions = {0, 1, 4, 6, 7, 9, /**/ 3, 5, 8, 10, 99, 99};
  auto const src_before = src;
  kvc::tools::HostCache<float> dst({1, 2, 4, 2});
  dst.track(0);
  std::vector<float> from(12), to(8, -1.0f);
  for (std::size_t i = 0; i < 12; ++i)
    from[i] = static_cast<float>(i);
  auto plan = make_plan(1, 2, 6, {{1, 3, 5}, {0, 2, 3}});
  REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, src.view(), dst.view(),
                      kvc::CarriedArray<float>{{from.data(), 1, 2, 6}, {to.data(), 1, 2, 4}})
              .ok());
  CHECK(dst.lengths == std::vector<Index>{3, 3});
  CHECK(dst.head_positions(0, 0) == std::vector<Index>{1, 6, 9});
  CHECK(dst.head_positions(0, 1) == std::vector<Index>{3, 8, 10});
  CHECK(to == std::vector<float>{1, 3, 5, -1, 6, 8, 9, -1});
  CHECK(dst.k[2] == src.k[6]);                      // head 0 slot 1 <- src slot 3
  CHECK(dst.v[(4 + 2) * 2] == src.v[(6 + 3) * 2]);  // head 1 slot 2 <- src slot 3
  CHECK(src.k == src_before.k);                     // src is not modified
  CHECK(src.positions == src_before.positions);
  CHECK(src.lengths == src_before.lengths);
  // A plan index past src's valid length is rejected.
  auto past = make_plan(1, 2, 6, {{1}, {4}});
  CHECK(kvc::gather(kvc::Cpu{}, past.plan, src.view(), dst.view()).code() == kvc::Errc::invalid_argument);
  // src without positions: dst receives src's slot numbers.
  auto plain = kvc::tools::HostCache<float>::random(e, 12);
  REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, plain.view(), dst.view()).ok());
  CHECK(dst.head_positions(0, 0) == std::vector<Index>{1, 3, 5});
  CHECK(dst.head_positions(0, 1) == std::vector<Index>{0, 2, 3});
  // dst with a per-sequence table cannot record unequal counts; nothing is written.
  kvc::tools::HostCache<float> seq({1, 2, 4, 2});
  seq.lengths = {0};
  auto const seq_before = seq;
  auto uneven = make_plan(1, 2, 6, {{1, 3}, {0, 2, 3}});
  CHECK(kvc::gather(kvc::Cpu{}, uneven.plan, src.view(), seq.view()).code() == kvc::Errc::invalid_argument);
  CHECK(seq.k == seq_before.k);
  CHECK(seq.lengths == seq_before.lengths);
}

TEST_CASE("compact: V's extents must match K's, and the plan and extras must not overlap the cache",
          "[pipeline][compact]") {
  // K holds 4 tokens, V only 2 (a view cut short): moving slot 3 would read V past its buffer.
  std::vector<float> k(4 * 2, 1.0f), v(2 * 2, 2.0f);
  std::vector<Index> lengths{4};
  auto const cache = kvc::make_cache(kvc::bhtd_rows(k.data(), {1, 1, 4, 2}), kvc::bhtd_rows(v.data(), {1, 1, 2, 2}),
                                     kvc::head_lengths(lengths.data(), 1));
  auto plan = make_plan(1, 1, 4, {{0, 3}});
  kvc::Status const st = kvc::compact(kvc::Cpu{}, plan.plan, cache);
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()) == "kvc::compact: the cache's values must have its keys' batch, heads and tokens");
  CHECK(lengths == std::vector<Index>{4});
  // A plan or an extra array living in K's memory would be overwritten while it is read.
  std::vector<float> v4(4 * 2, 2.0f);
  auto const whole = kvc::make_cache(kvc::bhtd_rows(k.data(), {1, 1, 4, 2}), kvc::bhtd_rows(v4.data(), {1, 1, 4, 2}),
                                     kvc::head_lengths(lengths.data(), 1));
  kvc::KeepPlan<> inside = plan.plan;
  inside.count = reinterpret_cast<Index*>(k.data());
  CHECK(kvc::compact(kvc::Cpu{}, inside, whole).code() == kvc::Errc::invalid_argument);
  kvc::TokenArray<float> const over_v{v4.data(), 1, 1, 4};
  CHECK(kvc::compact(kvc::Cpu{}, plan.plan, whole, over_v).code() == kvc::Errc::invalid_argument);
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, whole).ok());
  CHECK(lengths == std::vector<Index>{2});
}
