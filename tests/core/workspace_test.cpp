// SPDX-License-Identifier: Apache-2.0
// tests/core/workspace_test.cpp: workspace sizes saturate instead of wrapping, and entry points refuse a workspace
// smaller than the kernel's size before carving it (hostile extents that come from requests).
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/core/workspace.hpp>

#include "support/catch.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

using kvc::Index;

TEST_CASE("workspace: byte counts saturate instead of wrapping", "[core][workspace]") {
  CHECK(kvc::bytes_product(Index{3}, std::size_t{4}, 5) == 60);
  CHECK(kvc::bytes_product(Index{1} << 40, Index{1} << 40) == kvc::saturated_bytes);  // 2^80 bytes
  CHECK(kvc::bytes_product(Index{-1}, std::size_t{4}) == kvc::saturated_bytes);       // an invalid extent
  CHECK(kvc::bytes_sum(std::size_t{1}, std::size_t{2}) == 3);
  CHECK(kvc::bytes_sum(SIZE_MAX - 1, std::size_t{2}) == kvc::saturated_bytes);
  CHECK(kvc::workspace_round(65) == 128);
  CHECK(kvc::workspace_round(SIZE_MAX - 3) == kvc::saturated_bytes);  // was (SIZE_MAX - 3 + 63) / 64 * 64 = 0
  alignas(64) std::byte buf[128];
  kvc::WorkspaceCarver carve({buf, sizeof buf});
  CHECK(carve.take<double>(Index{1} << 61) == nullptr);  // 2^61 * 8 wraps to 0 bytes: refused, not handed out
  CHECK(carve.take<double>(16) != nullptr);
}

TEST_CASE("workspace: SnapKV over hostile extents asks for a saturated size and score refuses it",
          "[core][workspace]") {
  // 2^31 query heads per KV head x 2^40 tokens x 4 bytes: the column sums alone need 2^73 bytes.
  kvc::KVExtents const keys{1, 1, Index{1} << 40, 8};
  kvc::KVExtents const queries{1, Index{1} << 31, 1, 8};
  std::vector<float> row(8, 1.0f);
  kvc::WindowQueries<float> const wq{
      kvc::TokenRows<float const, kvc::StridedLayout>(row.data(), kvc::StridedLayout{queries, 0, 0, 0})};
  kvc::SnapKVScorer s;
  s.window_size = 1;
  auto const obs = kvc::observe(wq);
  CHECK(kvc::score_workspace_bytes(kvc::Cpu{}, s, keys, obs) == kvc::saturated_bytes);
  // The cache view is never read: score refuses the workspace first (no carve, no product that could wrap).
  auto const cache = kvc::dense_cache(row.data(), row.data(), kvc::KVExtents{1, 1, Index{1} << 40, 8});
  std::vector<float> out(1);
  kvc::ScoreSpan<> span{out.data(), 1, 1, Index{1} << 40};
  alignas(64) std::byte ws[4096];
  kvc::Status const st = kvc::score(kvc::Cpu{}, s, cache, obs, span, {ws, sizeof ws});
  CHECK(st.code() == kvc::Errc::out_of_capacity);
  // The selector too: 2^62 tokens of Index scratch.
  kvc::TopKSelector<kvc::FixedBudget> const sel{kvc::FixedBudget{4}};
  CHECK(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 1, 1, Index{1} << 62) == kvc::saturated_bytes);
}
