// SPDX-License-Identifier: Apache-2.0
// tests/core/validate_test.cpp mirrors include/kvc/core/validate.hpp (and the workspace carver).
#include <kvc/core/validate.hpp>
#include <kvc/core/workspace.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

using kvc::Errc;
using kvc::Index;

TEST_CASE("validate: a good dense cache passes; finiteness is opt-in", "[core][validate]") {
  auto c = kvc::tools::HostCache<float>::random({2, 2, 6, 4}, 1);
  CHECK(kvc::validate(c.view()).ok());
  CHECK(kvc::validate(c.view(), {.check_finite = true}).ok());
  c.v[17] = std::numeric_limits<float>::quiet_NaN();
  CHECK(kvc::validate(c.view()).ok());
  CHECK(kvc::validate(c.view(), {.check_finite = true}).code() == Errc::non_finite);
  c.v[17] = 0.0f;
  c.k[3] = std::numeric_limits<float>::infinity();
  CHECK(kvc::validate(c.view(), {.check_finite = true}).code() == Errc::non_finite);
  // Padding is not inspected: a NaN past the valid length is fine.
  c.k[3] = 0.0f;
  c.lengths = {6, 5};
  c.k[static_cast<std::size_t>(((1 * 2 + 1) * 6 + 5) * 4)] = std::numeric_limits<float>::quiet_NaN();
  CHECK(kvc::validate(c.view(), {.check_finite = true}).ok());
}

TEST_CASE("validate: shapes, lengths, overlap and 64-bit overflow", "[core][validate]") {
  std::vector<float> k(64), v(64);
  auto bad_dim = kvc::dense_cache(k.data(), v.data(), {1, 1, 4, 0});
  CHECK(kvc::validate(bad_dim).code() == Errc::invalid_argument);
  auto mismatch = kvc::make_cache(kvc::bhtd_rows(k.data(), {1, 2, 4, 4}), kvc::bhtd_rows(v.data(), {1, 2, 3, 4}));
  CHECK(kvc::validate(mismatch).code() == Errc::invalid_argument);
  std::vector<Index> lengths = {5};
  auto long_len = kvc::dense_cache(k.data(), v.data(), {1, 2, 4, 4}, -1, lengths.data());
  CHECK(kvc::validate(long_len).code() == Errc::invalid_argument);
  // Rows overlap: token stride 2 with dim 4.
  kvc::StridedLayout overlap{{1, 1, 4, 4}, 64, 16, 2};
  auto ov = kvc::make_cache(kvc::TokenRows<float, kvc::StridedLayout>(k.data(), overlap),
                            kvc::bhtd_rows(v.data(), {1, 1, 4, 4}));
  CHECK(kvc::validate(ov).code() == Errc::invalid_argument);
  // K and V are the same buffer.
  auto same = kvc::dense_cache(k.data(), k.data(), {1, 1, 4, 4});
  CHECK(kvc::validate(same).code() == Errc::invalid_argument);
  // Sliced strides (every other head of a bigger buffer) are fine.
  kvc::StridedLayout sliced{{1, 2, 4, 4}, 64, 32, 4};
  auto sl = kvc::make_cache(kvc::TokenRows<float, kvc::StridedLayout>(k.data(), sliced),
                            kvc::TokenRows<float, kvc::StridedLayout>(v.data(), sliced));
  CHECK(kvc::validate(sl).ok());
  // Extents whose element count overflows int64.
  Index const big = Index{1} << 32;
  auto huge = kvc::dense_cache(k.data(), v.data(), {big, big, 4, 4});
  CHECK(kvc::validate(huge).code() == Errc::invalid_argument);
}

TEST_CASE("validate: paged layouts need covering tables and non-overlapping strides", "[core][validate]") {
  std::vector<float> pool(4 * 2 * 2 * 4), vpool(pool.size());
  std::vector<std::int32_t> table = {0, 1};
  auto const ok = kvc::paged_layout({1, 2, 4, 4}, 2, kvc::PageOrder::nhd, table.data(), 2, 4);
  kvc::TokenRows<float, kvc::PagedLayout> rows(pool.data(), ok), vrows(vpool.data(), ok);
  CHECK(kvc::validate(kvc::make_cache(rows, vrows)).ok());
  auto bad_stride = ok;
  bad_stride.stride_t = 2;  // rows of one page overlap
  kvc::TokenRows<float, kvc::PagedLayout> rows3(pool.data(), bad_stride);
  CHECK(kvc::validate(kvc::make_cache(rows3, vrows)).code() == Errc::invalid_argument);
  auto const short_table = kvc::paged_layout({1, 2, 8, 4}, 2, kvc::PageOrder::nhd, table.data(), 2, 4);
  kvc::TokenRows<float, kvc::PagedLayout> rows2(pool.data(), short_table);
  CHECK(kvc::validate(kvc::make_cache(rows2, rows2)).code() == Errc::invalid_argument);
}

TEST_CASE("workspace: carving is aligned and refuses to overrun", "[core][workspace]") {
  alignas(64) std::byte buf[256];
  kvc::WorkspaceCarver carve({buf, sizeof buf});
  auto* a = carve.take<float>(3);
  auto* b = carve.take<double>(2);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(b) % kvc::workspace_alignment == 0);
  CHECK(carve.take<float>(1000) == nullptr);
  CHECK(kvc::WorkspaceCarver({}).take<float>(0) == nullptr);
  CHECK(kvc::WorkspaceCarver({}).take<float>(1) == nullptr);
}
