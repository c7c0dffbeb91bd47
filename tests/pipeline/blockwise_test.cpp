// SPDX-License-Identifier: Apache-2.0
// tests/pipeline/blockwise_test.cpp mirrors include/kvc/pipeline/blockwise.hpp: KeyDiff's Eq. 6 protocol, with the
// spec's golden traces (specs/key_diff.md §9, properties 16-21).
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/blockwise.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cmath>
#include <vector>

using kvc::Index;

namespace {

struct Run {
  std::vector<Index> kept;
  kvc::tools::HostCache<float> work;
};

Run blockwise(std::vector<float> keys, Index dim, Index budget, Index block, Index n_recent = 0) {
  Index const n = static_cast<Index>(keys.size()) / dim;
  kvc::KVExtents const e{1, 1, n, dim};
  auto const src = kvc::dense_cache(keys.data(), keys.data(), e);
  kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::FixedBudget{budget}, 0, n_recent}};
  Index const cap = kvc::blockwise_capacity(press.selector, block);
  kvc::tools::HostCache<float> work({1, 1, cap, dim});
  work.track(0);  // empty, with a per-head length table and positions: the driver's state
  kvc::test::OwnedWorkspace ws(kvc::blockwise_workspace_bytes(kvc::Cpu{}, press, work.ext));
  REQUIRE(kvc::blockwise_compress(kvc::Cpu{}, press, src, block, work.view(), ws.get()).ok());
  return {work.head_positions(0, 0), std::move(work)};
}

}  // namespace

TEST_CASE("blockwise: golden block trace (N = 4, B = 3)", "[pipeline][blockwise]") {
  std::vector<float> const k = {1, 0, 3, 1, 0, 2, -1, 1, 2, 2, 1, -1, 0, -1};
  auto const r = blockwise(k, 2, 4, 3);
  CHECK(r.kept == std::vector<Index>{2, 3, 5, 6});
  CHECK(blockwise(k, 2, 4, 100).kept == std::vector<Index>{2, 3, 5, 6});  // same as B = infinity here
  // The working cache holds exactly the kept rows, in ascending position order.
  CHECK(r.work.k[0] == 0.0f);
  CHECK(r.work.k[1] == 2.0f);
  CHECK(r.work.k[6] == 0.0f);
  CHECK(r.work.k[7] == -1.0f);
}

TEST_CASE("blockwise: decisions depend on the path (B = 2 vs B = infinity)", "[pipeline][blockwise]") {
  std::vector<float> const k = {2, -1, -1, 3, 1, 2, 2, 1, 1, 3, -1, -1, 3, -1};
  CHECK(blockwise(k, 2, 3, 2).kept == std::vector<Index>{1, 5, 6});
  CHECK(blockwise(k, 2, 3, 7).kept == std::vector<Index>{0, 1, 5});
}

TEST_CASE("blockwise: decode (B = 1) can evict the token just appended", "[pipeline][blockwise]") {
  // Three keys, then one along the sum U of their unit keys: it is parallel to the anchor of all four (cos = 1),
  // so it is the one evicted, although it just arrived.
  double const r = std::sqrt(1.04);
  std::vector<float> const k = {1, 0, 0, 1, -1, 0.2f, static_cast<float>(1 - 1 / r), static_cast<float>(1 + 0.2 / r)};
  CHECK(blockwise(k, 2, 3, 1).kept == std::vector<Index>{0, 1, 2});
}

TEST_CASE("blockwise: cache size is min(seen, N), B >= T equals one-shot scoring", "[pipeline][blockwise]") {
  kvc::tools::Rng rng(12);
  std::vector<float> k(200 * 8);
  for (float& x : k)
    x = rng.normal() + 0.3f;
  for (Index block : {1, 16, 32, 200, 500}) {
    auto const r = blockwise(k, 8, 64, block);
    CHECK(r.kept.size() == 64);
  }
  // One-shot reference: score all 200 and keep the top 64.
  kvc::KVExtents const e{1, 1, 200, 8};
  auto const src = kvc::dense_cache(k.data(), k.data(), e);
  kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::FixedBudget{64}}};
  kvc::test::OwnedPlan plan(1, 1, 200);
  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
  REQUIRE(kvc::compress(kvc::Cpu{}, press, src, plan.plan, ws.get()).ok());
  CHECK(blockwise(k, 8, 64, 200).kept == plan.kept(0, 0));
  CHECK(blockwise(k, 8, 300, 16).kept.size() == 200);  // budget above T keeps everything
}

TEST_CASE("blockwise: KeyDiff + Recent keeps the last tokens of every step", "[pipeline][blockwise]") {
  kvc::tools::Rng rng(3);
  std::vector<float> k(50 * 4);
  for (float& x : k)
    x = rng.normal();
  auto const kept = blockwise(k, 4, 10, 5, 3).kept;
  REQUIRE(kept.size() == 10);
  CHECK(kept[7] == 47);
  CHECK(kept[8] == 48);
  CHECK(kept[9] == 49);
}

TEST_CASE("blockwise: bad arguments are errors", "[pipeline][blockwise]") {
  std::vector<float> k(8, 1.0f);
  auto const src = kvc::dense_cache(k.data(), k.data(), {1, 1, 4, 2});
  kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::FixedBudget{2}}};
  kvc::tools::HostCache<float> small({1, 1, 2, 2}), work({1, 1, 4, 2}), untracked({1, 1, 4, 2});
  small.track(0);
  work.track(0);
  kvc::test::OwnedWorkspace ws(kvc::blockwise_workspace_bytes(kvc::Cpu{}, press, work.ext));
  CHECK(kvc::blockwise_compress(kvc::Cpu{}, press, src, 0, work.view(), ws.get()).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::blockwise_compress(kvc::Cpu{}, press, src, 2, small.view(), ws.get()).code() ==
        kvc::Errc::out_of_capacity);
  CHECK(kvc::blockwise_compress(kvc::Cpu{}, press, src, 2, work.view(), {}).code() == kvc::Errc::out_of_capacity);
  CHECK(kvc::blockwise_compress(kvc::Cpu{}, press, src, 2, untracked.view(), ws.get()).code() ==
        kvc::Errc::invalid_argument);  // no length table, no positions
}
