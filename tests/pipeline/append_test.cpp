// SPDX-License-Identifier: Apache-2.0
// tests/pipeline/append_test.cpp mirrors kvc::append in include/kvc/pipeline/compact.hpp (CPU kernel in
// backend/cpu/pipeline/compact.hpp): new tokens land after each head's valid length with their positions, and the
// prefill -> compress -> compact -> append -> compress cycle keeps rows and positions in step.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <set>
#include <vector>

using kvc::Errc;
using kvc::Index;

namespace {

/// A cache whose K row (b, h, t) is filled with the value `id(b, h, t)` and V with its negative.
kvc::tools::HostCache<float> labelled(kvc::KVExtents e, float base) {
  kvc::tools::HostCache<float> c(e);
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < e.heads; ++h)
      for (Index t = 0; t < e.tokens; ++t) {
        float const id = base + static_cast<float>(100 * b + 10 * h + t);
        std::fill_n(c.key(b, h, t), e.dim, id);
        std::fill_n(c.v.begin() + ((b * e.heads + h) * e.tokens + t) * e.dim, e.dim, -id);
      }
  return c;
}

float key0(kvc::tools::HostCache<float> const& c, Index b, Index h, Index t) {
  return c.k[static_cast<std::size_t>(((b * c.ext.heads + h) * c.ext.tokens + t) * c.ext.dim)];
}
float value0(kvc::tools::HostCache<float> const& c, Index b, Index h, Index t) {
  return c.v[static_cast<std::size_t>(((b * c.ext.heads + h) * c.ext.tokens + t) * c.ext.dim)];
}

}  // namespace

TEST_CASE("append: rows land after each head's length, with positions and new lengths", "[pipeline][append]") {
  auto dst = labelled({2, 2, 8, 3}, 0.0f);
  dst.track(0);
  dst.lengths = {3, 1, 5, 0};
  std::vector<Index> const old_positions = {0, 1, 2, 9, 9, 9, 9, 9, /**/ 4, 9, 9, 9, 9, 9, 9, 9,
                                            0, 2, 4, 6, 8, 9, 9, 9, /**/ 9, 9, 9, 9, 9, 9, 9, 9};
  dst.positions = old_positions;
  auto src = labelled({2, 2, 2, 3}, 1000.0f);
  src.positions = {10, 11, 20, 21, 30, 31, 40, 41};

  REQUIRE(kvc::append(kvc::Cpu{}, dst.view(), src.view()).ok());
  CHECK(dst.lengths == std::vector<Index>{5, 3, 7, 2});
  // Head (0, 0): slots 3, 4 <- src (0, 0, 0..1); head (0, 1): slots 1, 2; head (1, 0): slots 5, 6; head (1, 1): 0, 1.
  CHECK(key0(dst, 0, 0, 2) == 2.0f);  // untouched
  CHECK(key0(dst, 0, 0, 3) == 1000.0f);
  CHECK(key0(dst, 0, 0, 4) == 1001.0f);
  CHECK(value0(dst, 0, 0, 4) == -1001.0f);
  CHECK(key0(dst, 0, 0, 5) == 5.0f);  // past the new length: untouched
  CHECK(key0(dst, 0, 1, 0) == 10.0f);
  CHECK(key0(dst, 0, 1, 1) == 1010.0f);
  CHECK(key0(dst, 0, 1, 2) == 1011.0f);
  CHECK(key0(dst, 1, 0, 5) == 1100.0f);
  CHECK(key0(dst, 1, 0, 6) == 1101.0f);
  CHECK(key0(dst, 1, 1, 0) == 1110.0f);
  CHECK(key0(dst, 1, 1, 1) == 1111.0f);
  CHECK(dst.head_positions(0, 0) == std::vector<Index>{0, 1, 2, 10, 11});
  CHECK(dst.head_positions(0, 1) == std::vector<Index>{4, 20, 21});
  CHECK(dst.head_positions(1, 0) == std::vector<Index>{0, 2, 4, 6, 8, 30, 31});
  CHECK(dst.head_positions(1, 1) == std::vector<Index>{40, 41});
  CHECK(kvc::validate(dst.view()).ok());  // positions still strictly ascending per head
}

TEST_CASE("append: src without positions gives its slot numbers, begin and count clip to src's lengths",
          "[pipeline][append]") {
  auto dst = labelled({1, 2, 10, 2}, 0.0f);
  dst.track(2);
  auto src = labelled({1, 2, 6, 2}, 500.0f);
  src.lengths = {6, 3};
  src.per_head = true;
  // Tokens [2, 2 + 3) of src: head 0 gets src slots 2..4, head 1 only slot 2 (its length is 3).
  REQUIRE(kvc::append(kvc::Cpu{}, dst.view(), src.view(), 2, 3).ok());
  CHECK(dst.lengths == std::vector<Index>{5, 3});
  CHECK(dst.head_positions(0, 0) == std::vector<Index>{0, 1, 2, 3, 4});  // src slot numbers 2, 3, 4
  CHECK(dst.head_positions(0, 1) == std::vector<Index>{0, 1, 2});
  CHECK(key0(dst, 0, 0, 2) == 502.0f);
  CHECK(key0(dst, 0, 0, 4) == 504.0f);
  CHECK(key0(dst, 0, 1, 2) == 512.0f);
  // A begin past every source length appends nothing.
  auto const before = dst;
  REQUIRE(kvc::append(kvc::Cpu{}, dst.view(), src.view(), 6, 4).ok());
  CHECK(dst.k == before.k);
  CHECK(dst.lengths == before.lengths);
  CHECK(kvc::append(kvc::Cpu{}, dst.view(), src.view(), -1, 2).code() == Errc::invalid_argument);
  CHECK(kvc::append(kvc::Cpu{}, dst.view(), src.view(), 0, -2).code() == Errc::invalid_argument);
}

TEST_CASE("append: element types convert and dims must agree", "[pipeline][append]") {
  kvc::tools::HostCache<kvc::half> dst({1, 1, 4, 2});
  dst.track(1);
  auto src = kvc::tools::HostCache<float>::random({1, 1, 2, 2}, 3);
  REQUIRE(kvc::append(kvc::Cpu{}, dst.view(), src.view()).ok());
  CHECK(kvc::to_float(dst.k[2]) == kvc::to_float(kvc::half(src.k[0])));
  CHECK(kvc::to_float(dst.v[5]) == kvc::to_float(kvc::half(src.v[3])));  // slot 2, channel 1
  auto wide = kvc::tools::HostCache<float>::random({1, 1, 2, 4}, 3);
  CHECK(kvc::append(kvc::Cpu{}, dst.view(), wide.view()).code() == Errc::invalid_argument);
  auto other_heads = kvc::tools::HostCache<float>::random({1, 2, 2, 2}, 3);
  CHECK(kvc::append(kvc::Cpu{}, dst.view(), other_heads.view()).code() == Errc::invalid_argument);
}

TEST_CASE("append: out_of_capacity leaves dst untouched", "[pipeline][append]") {
  auto dst = labelled({2, 2, 6, 2}, 0.0f);
  dst.track(0);
  dst.lengths = {2, 2, 2, 5};  // head (1, 1) has room for one more token only
  auto const before = dst;
  auto src = labelled({2, 2, 2, 2}, 1000.0f);
  CHECK(kvc::append(kvc::Cpu{}, dst.view(), src.view()).code() == Errc::out_of_capacity);
  CHECK(dst.k == before.k);
  CHECK(dst.v == before.v);
  CHECK(dst.lengths == before.lengths);
  CHECK(dst.positions == before.positions);
  // One token fits everywhere.
  REQUIRE(kvc::append(kvc::Cpu{}, dst.view(), src.view(), 0, 1).ok());
  CHECK(dst.lengths == std::vector<Index>{3, 3, 3, 6});
  // A length past the capacity is rejected, not written through.
  dst.lengths = {3, 3, 3, 7};
  auto const bad = dst;
  CHECK(kvc::append(kvc::Cpu{}, dst.view(), src.view(), 0, 0).code() == Errc::invalid_argument);
  CHECK(dst.k == bad.k);
}

TEST_CASE("append: a per-sequence table needs equal counts per sequence, no table is rejected", "[pipeline][append]") {
  auto dst = labelled({1, 2, 8, 2}, 0.0f);
  dst.lengths = {2};  // per sequence: both heads hold 2
  auto src = labelled({1, 2, 3, 2}, 1000.0f);
  src.lengths = {3, 2};  // head 1 appends fewer tokens
  src.per_head = true;
  auto const before = dst;
  CHECK(kvc::append(kvc::Cpu{}, dst.view(), src.view()).code() == Errc::invalid_argument);
  CHECK(dst.k == before.k);
  CHECK(dst.lengths == before.lengths);
  // Equal counts are fine with a per-sequence table.
  src.lengths = {3, 3};
  REQUIRE(kvc::append(kvc::Cpu{}, dst.view(), src.view()).ok());
  CHECK(dst.lengths == std::vector<Index>{5});
  CHECK(key0(dst, 0, 1, 4) == 1012.0f);
  // No table: the cache cannot grow.
  auto none = labelled({1, 2, 8, 2}, 0.0f);
  auto const untouched = none;
  CHECK(kvc::append(kvc::Cpu{}, none.view(), src.view()).code() == Errc::invalid_argument);
  CHECK(none.k == untouched.k);
}

TEST_CASE("append: prefill -> compress -> compact -> append -> compress keeps positions consistent",
          "[pipeline][append]") {
  kvc::KVExtents const prefill{2, 2, 40, 16};
  Index const added = 8, w = 4;
  auto const prompt = kvc::tools::HostCache<float>::random(prefill, 71);
  // The engine's working cache: capacity for the prompt and the new tokens, per-head lengths, positions.
  kvc::tools::HostCache<float> work({2, 2, 40 + added, 16});
  work.track(0);
  REQUIRE(kvc::append(kvc::Cpu{}, work.view(), prompt.view()).ok());
  CHECK(work.lengths == std::vector<Index>{40, 40, 40, 40});

  // 1. Compress the prefill per head with KeyDiff (heads keep different sets), compact.
  kvc::Press const first{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}, 0, 2}};
  kvc::test::OwnedWorkspace ws1(kvc::compress_workspace_bytes(kvc::Cpu{}, first, work.ext));
  kvc::test::OwnedPlan plan1(2, 2, work.ext.tokens);
  REQUIRE(kvc::compress(kvc::Cpu{}, first, work.view(), plan1.plan, ws1.get()).ok());
  REQUIRE(kvc::compact(kvc::Cpu{}, plan1.plan, work.view()).ok());
  CHECK(work.lengths == std::vector<Index>{20, 20, 20, 20});
  std::vector<std::set<Index>> after_first;
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 2; ++h) {
      auto const pos = work.head_positions(b, h);
      CHECK(pos == plan1.kept(b, h));  // slot j now holds the token at position plan[j]
      after_first.emplace_back(pos.begin(), pos.end());
    }

  // 2. Decode `added` tokens: positions 40..47 (new K and V rows, already rotated).
  auto fresh = kvc::tools::HostCache<float>::random({2, 2, added, 16}, 72);
  fresh.track(added);
  for (Index& p : fresh.positions)
    p += 40;
  REQUIRE(kvc::append(kvc::Cpu{}, work.view(), fresh.view()).ok());
  CHECK(work.lengths == std::vector<Index>{28, 28, 28, 28});
  REQUIRE(kvc::validate(work.view()).ok());

  // 3. Compress again with SnapKV (window = the last w new tokens' queries, at the default positions 44..47).
  kvc::test::OwnedQueries<float> q({2, 4, w, 16});
  q.data = kvc::tools::random_values<float>(static_cast<Index>(q.data.size()), 73, 2.0f);
  auto const obs = kvc::observe(kvc::WindowQueries<float>{q.rows()});
  kvc::Press const second{kvc::SnapKVScorer{kvc::Reference::authors, w, 7, kvc::Pooling::max, kvc::GqaReduce::mean},
                          kvc::TopKSelector{kvc::FixedBudget{12}}};
  kvc::test::OwnedWorkspace ws2(kvc::compress_workspace_bytes(kvc::Cpu{}, second, work.ext, obs));
  kvc::test::OwnedPlan plan2(2, 2, work.ext.tokens);
  REQUIRE(kvc::compress(kvc::Cpu{}, second, work.view(), obs, plan2.plan, ws2.get()).ok());
  auto const before = work;
  REQUIRE(kvc::compact(kvc::Cpu{}, plan2.plan, work.view()).ok());
  CHECK(work.lengths == std::vector<Index>{12, 12, 12, 12});
  REQUIRE(kvc::validate(work.view()).ok());
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 2; ++h) {
      auto const pos = work.head_positions(b, h);
      auto const& earlier = after_first[static_cast<std::size_t>(b * 2 + h)];
      for (Index p : pos)
        CHECK((earlier.count(p) == 1 || (p >= 40 && p < 40 + added)));
      for (Index p = 44; p < 48; ++p)  // the observation window is kept
        CHECK(std::count(pos.begin(), pos.end(), p) == 1);
      // Every kept row is the row of its position: the prompt's for p < 40, the appended one's otherwise.
      for (Index j = 0; j < 12; ++j) {
        Index const p = pos[static_cast<std::size_t>(j)];
        float const* row = work.key(b, h, j);
        float const* expect = p < 40 ? prompt.k.data() + ((b * 2 + h) * 40 + p) * 16
                                     : fresh.k.data() + ((b * 2 + h) * added + (p - 40)) * 16;
        CHECK(std::equal(row, row + 16, expect));
        Index const slot = plan2.kept(b, h)[static_cast<std::size_t>(j)];
        CHECK(before.positions[static_cast<std::size_t>((b * 2 + h) * work.ext.tokens + slot)] == p);
      }
    }
}
