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

TEST_CASE("validate: a good dense cache passes, finiteness is opt-in", "[core][validate]") {
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

namespace {

/// A paged K/V pair over a pool of `num_pages` pages for extents `e` (page size 2, NHD), with lengths.
struct PagedPair {
  std::vector<float> kpool, vpool;
  kvc::PagedLayout layout;
  PagedPair(kvc::PagedLayout l)
      : kpool(static_cast<std::size_t>(l.num_pages * l.stride_page)), vpool(kpool.size()), layout(l) {}
  kvc::Status validate(kvc::Lengths lengths = {}) {
    return kvc::validate(kvc::make_cache(kvc::TokenRows<float, kvc::PagedLayout>(kpool.data(), layout),
                                         kvc::TokenRows<float, kvc::PagedLayout>(vpool.data(), layout), lengths));
  }
};

}  // namespace

TEST_CASE("validate: a block-table page id outside the pool is rejected only within the valid length",
          "[core][validate]") {
  kvc::KVExtents const e{2, 2, 8, 4};  // page size 2: 4 pages per sequence
  std::vector<std::int32_t> table = {0, 1, 2, 3, /* seq 1 */ 4, 5, 6, 7};
  PagedPair p(kvc::paged_layout(e, 2, kvc::PageOrder::nhd, table.data(), 4, 8));
  CHECK(p.validate().ok());
  table[2] = -1;  // sequence 0's third page (tokens 4, 5)
  CHECK(p.validate().code() == Errc::invalid_argument);
  std::vector<Index> lengths = {4, 8};  // sequence 0 holds 4 tokens: the -1 is past its valid length
  CHECK(p.validate(lengths.data()).ok());
  lengths = {5, 8};  // token 4 lives on the bad page
  CHECK(p.validate(lengths.data()).code() == Errc::invalid_argument);
  table[2] = 2;
  table[7] = 8;  // == num_pages
  CHECK(p.validate().code() == Errc::invalid_argument);
  std::vector<Index> per_head = {8, 8, 6, 5};  // sequence 1's longest head needs 3 pages: page 7 unused
  CHECK(p.validate(kvc::head_lengths(per_head.data(), 2)).ok());
  per_head = {8, 8, 6, 7};
  CHECK(p.validate(kvc::head_lengths(per_head.data(), 2)).code() == Errc::invalid_argument);
  table[7] = 1000;
  per_head = {8, 8, 0, 6};
  CHECK(p.validate(kvc::head_lengths(per_head.data(), 2)).ok());
}

TEST_CASE("validate: CSR page lists must lie inside page_indices and cover each sequence", "[core][validate]") {
  kvc::KVExtents const e{2, 1, 8, 4};
  std::vector<std::int32_t> indptr = {0, 4, 8}, indices = {3, 1, 0, 2, 7, 6, 5, 4};
  PagedPair p(kvc::paged_layout_csr(e, 2, kvc::PageOrder::hnd, indptr.data(), indices.data(), 8, 8));
  CHECK(p.validate().ok());
  p.layout.num_page_indices = 7;  // indptr[2] = 8 points past the declared index array
  CHECK(p.validate().code() == Errc::invalid_argument);
  p.layout.num_page_indices = 8;
  indptr = {0, 3, 8};  // sequence 0's list holds 3 pages, it needs 4 for 8 tokens
  CHECK(p.validate().code() == Errc::invalid_argument);
  std::vector<Index> lengths = {6, 8};  // 6 tokens need only 3 pages
  CHECK(p.validate(lengths.data()).ok());
  indptr = {0, 4, 3};  // decreasing
  CHECK(p.validate().code() == Errc::invalid_argument);
  indptr = {-1, 4, 8};
  CHECK(p.validate().code() == Errc::invalid_argument);
  indptr = {0, 4, 8};
  indices[5] = -3;
  CHECK(p.validate().code() == Errc::invalid_argument);
}

TEST_CASE("validate: per-head lengths must be in [0, tokens]", "[core][validate]") {
  auto c = kvc::tools::HostCache<float>::random({2, 2, 6, 4}, 3);
  c.lengths = {6, 0, 3, 6};
  c.per_head = true;
  CHECK(kvc::validate(c.view()).ok());
  c.lengths = {6, 0, 7, 6};
  CHECK(kvc::validate(c.view()).code() == Errc::invalid_argument);
  c.lengths = {6, -1, 3, 6};
  CHECK(kvc::validate(c.view()).code() == Errc::invalid_argument);
  c.lengths = {6, 6, 6, 6};
  c.per_head = false;  // read per sequence, only entries 0 and 1 matter
  CHECK(kvc::validate(c.view()).ok());
}

TEST_CASE("validate: positions must be >= 0 and strictly ascending within each head's valid length",
          "[core][validate]") {
  auto c = kvc::tools::HostCache<float>::random({1, 2, 5, 2}, 4);
  c.track(5);
  c.positions = {0, 3, 4, 9, 10, /**/ 2, 5, 6, 7, 8};
  CHECK(kvc::validate(c.view()).ok());
  c.positions = {0, 3, 3, 9, 10, /**/ 2, 5, 6, 7, 8};  // equal neighbours
  CHECK(kvc::validate(c.view()).code() == Errc::invalid_argument);
  c.positions = {0, 3, 4, 9, 10, /**/ 2, 5, 6, 8, 7};  // descending at the end of head 1
  CHECK(kvc::validate(c.view()).code() == Errc::invalid_argument);
  c.positions = {-1, 3, 4, 9, 10, /**/ 2, 5, 6, 7, 8};
  CHECK(kvc::validate(c.view()).code() == Errc::invalid_argument);
  c.lengths = {5, 3};  // past head 1's valid length, positions are not read
  c.positions = {0, 3, 4, 9, 10, /**/ 2, 5, 6, 1, -4};
  CHECK(kvc::validate(c.view()).ok());
}

TEST_CASE("validate: a per-head length table must have the cache's KV heads", "[core][validate]") {
  auto c = kvc::tools::HostCache<float>::random({1, 2, 6, 4}, 5);
  std::vector<Index> table = {6, 6};
  // [batch, 1] declared for a 2-head cache: kernels would index it as b * 1 + h and read the wrong entries.
  auto const wrong = kvc::dense_cache(c.k.data(), c.v.data(), c.ext, kvc::head_lengths(table.data(), 1));
  CHECK(kvc::validate(wrong).code() == Errc::invalid_argument);
  auto const right = kvc::dense_cache(c.k.data(), c.v.data(), c.ext, kvc::head_lengths(table.data(), 2));
  CHECK(kvc::validate(right).ok());
}

TEST_CASE("validate: packed K||V rows and one-token HND pages are valid, a corrupt CSR pointer is caught first",
          "[core][validate]") {
  // Packed [B, H, N, dk + dv] buffer: K is the first 4 channels of each row, V the next 4 (a documented layout).
  kvc::KVExtents const e{1, 2, 3, 4};
  std::vector<float> packed(static_cast<std::size_t>(e.rows() * 8));
  kvc::StridedLayout const kl{e, 2 * 3 * 8, 3 * 8, 8};
  kvc::TokenRows<float, kvc::StridedLayout> const k(packed.data(), kl), v(packed.data() + 4, kl);
  CHECK(kvc::validate(kvc::make_cache(k, v)).ok());
  kvc::TokenRows<float, kvc::StridedLayout> const v_overlap(packed.data() + 2, kl);  // V starts inside K's row
  CHECK(kvc::validate(kvc::make_cache(k, v_overlap)).code() == Errc::invalid_argument);
  // HND pages of one token: stride_h == stride_t == dim.
  std::vector<std::int32_t> table = {0, 1, 2};
  auto const hnd1 = kvc::paged_layout({1, 2, 3, 4}, 1, kvc::PageOrder::hnd, table.data(), 3, 3);
  std::vector<float> kpool(3 * 2 * 4), vpool(kpool.size());
  CHECK(kvc::validate(kvc::make_cache(kvc::TokenRows<float, kvc::PagedLayout>(kpool.data(), hnd1),
                                      kvc::TokenRows<float, kvc::PagedLayout>(vpool.data(), hnd1)))
            .ok());
  // CSR indptr {0, 100, 5} with 10 indices: rejected before sequence 0's 100 "pages" are read.
  std::vector<std::int32_t> indptr = {0, 100, 5}, indices(10, 0);
  auto const csr = kvc::paged_layout_csr({2, 2, 320, 4}, 16, kvc::PageOrder::nhd, indptr.data(), indices.data(), 10, 4);
  std::vector<float> pool(4 * 16 * 2 * 4);
  kvc::TokenRows<float, kvc::PagedLayout> const rows(pool.data(), csr);
  CHECK(kvc::validate_rows(rows).code() == Errc::invalid_argument);
}
