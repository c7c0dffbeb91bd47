// SPDX-License-Identifier: Apache-2.0
// tests/core/validate_test.cpp mirrors include/kvc/core/validate.hpp (and the workspace carver).
#include <kvc/core/validate.hpp>
#include <kvc/core/workspace.hpp>
#include <kvc/store/ragged.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
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

TEST_CASE("validate: strides and extents whose offsets overflow 64 bits are rejected, not wrapped",
          "[core][validate]") {
  std::vector<float> k(64), v(64);
  using Rows = kvc::TokenRows<float, kvc::StridedLayout>;
  Index const big = Index{1} << 62;
  auto message = [&](kvc::StridedLayout const& l) {
    return std::string(kvc::validate_rows(Rows(k.data(), l)).message());
  };
  // stride 2^62 with extent 3: the largest offset 2^62 * 2 = 2^63 does not fit.
  kvc::StridedLayout const wide{{1, 1, 3, 4}, 0, 0, big};
  CHECK(message(wide) == "StridedLayout: offsets overflow 64 bits");
  // Every stride * (extent - 1) fits and rows do not overlap, but the largest offset, their sum, does not:
  // 4 + 2^60 + (2^61 + 2^60) + (2^62 + 2^61) = 2^63 + 2^61 + 4.
  kvc::StridedLayout const sum{
      {2, 2, 2, 4}, big + (Index{1} << 61), (Index{1} << 61) + (Index{1} << 60), Index{1} << 60};
  CHECK(message(sum) == "StridedLayout: offsets overflow 64 bits");
  // 2^61 + 2^60 + 2^59 + 4 elements fit in 64 bits, not as float bytes.
  kvc::StridedLayout const bytes{{2, 2, 2, 4}, Index{1} << 61, Index{1} << 60, Index{1} << 59};
  CHECK(message(bytes) == "kvc::validate: the bytes a K or V view spans overflow 64 bits");
  kvc::StridedLayout const fits{{2, 2, 2, 4}, Index{1} << 59, Index{1} << 58, Index{1} << 56};
  CHECK(kvc::validate_rows(Rows(k.data(), fits)).ok());
  // Extents: 2^62 tokens of dim 4 overflow the element count.
  kvc::StridedLayout const long_tokens{{1, 1, big, 4}, 0, 0, 4};
  CHECK(kvc::validate_rows(Rows(k.data(), long_tokens)).code() == Errc::invalid_argument);
}

TEST_CASE("validate: paged fields, products and page ids cannot overflow or be negative", "[core][validate]") {
  std::vector<float> pool(4 * 2 * 2 * 4);
  std::vector<std::int32_t> table = {0, 1};
  using Rows = kvc::TokenRows<float, kvc::PagedLayout>;
  auto const ok = kvc::paged_layout({1, 2, 4, 4}, 2, kvc::PageOrder::nhd, table.data(), 2, 4);
  REQUIRE(kvc::validate_rows(Rows(pool.data(), ok)).ok());
  auto named = [&](kvc::PagedLayout const& l) {
    return std::string(kvc::validate_rows(Rows(pool.data(), l)).message());
  };
  auto l = ok;
  l.stride_page = -16;
  CHECK(named(l) == "PagedLayout: `stride_page` must be >= 0");
  l = ok;
  l.stride_h = -4;
  CHECK(named(l) == "PagedLayout: `stride_h` must be >= 0");
  l = ok;
  l.stride_t = -8;
  CHECK(named(l) == "PagedLayout: `stride_t` must be >= 0");
  l = ok;
  l.page_size = -2;
  CHECK(named(l) == "PagedLayout: `page_size` must be > 0");
  l = ok;
  l.page_size = std::numeric_limits<Index>::min();
  CHECK(named(l) == "PagedLayout: `page_size` must be > 0");
  l = ok;
  l.num_pages = -1;
  CHECK(named(l) == "PagedLayout: `num_pages` must be >= 0");
  l = ok;
  l.max_pages = -2;
  CHECK(named(l) == "PagedLayout: `max_pages` must be >= 0");
  // An empty view with a negative pool size is still rejected.
  l = kvc::paged_layout({1, 2, 0, 4}, 2, kvc::PageOrder::nhd, table.data(), 2, -4);
  CHECK(named(l) == "PagedLayout: `num_pages` must be >= 0");

  Index const big = Index{1} << 62;
  l = ok;
  l.stride_page = big;  // the last page starts at stride_page * (num_pages - 1) = 3 * 2^62
  CHECK(named(l) == "PagedLayout: pool offsets overflow 64 bits");
  l = ok;
  l.stride_page = big / 2;  // 2^61 * 3 + ... elements fit in 64 bits, not as float bytes
  CHECK(named(l) == "kvc::validate: the bytes a K or V view spans overflow 64 bits");
  l = ok;
  l.page_size = big;  // max_pages * page_size = 2^63
  CHECK(named(l) == "PagedLayout: max_pages * page_size overflows 64 bits");
  // In-page token stride 2^62 over 4 token slots of a page: 3 * 2^62 (the old check multiplied stride_t by
  // page_size unchecked).
  l = kvc::paged_layout({1, 2, 4, 4}, 4, kvc::PageOrder::nhd, table.data(), 1, 4);
  l.stride_t = big;
  CHECK(named(l) == "PagedLayout: pool offsets overflow 64 bits");
  // Head stride 2^62 over 3 heads.
  l = kvc::paged_layout({1, 3, 4, 4}, 4, kvc::PageOrder::hnd, table.data(), 1, 4);
  l.stride_h = big;
  CHECK(named(l) == "PagedLayout: pool offsets overflow 64 bits");
  // In-page strides that interleave rows of different heads and tokens (stride_h 8 with 2 heads needs
  // stride_t >= 16): the old check accepted it.
  l = kvc::paged_layout({1, 2, 4, 4}, 2, kvc::PageOrder::nhd, table.data(), 2, 4);
  l.stride_h = 8;
  l.stride_t = 8;
  CHECK(named(l) == "PagedLayout: rows overlap (a page or in-page stride is smaller than the block inside it)");
  l = kvc::paged_layout({1, 2, 4, 4}, 2, kvc::PageOrder::nhd, table.data(), big / 2, 4);  // batch 1: table fits
  CHECK(kvc::validate_rows(Rows(pool.data(), l)).ok());
  l.ext.batch = 5;  // batch * max_pages = 5 * 2^61
  CHECK(named(l) == "PagedLayout: the block table's size batch * max_pages overflows 64 bits");
  // A huge page size with a short valid length: ceil(length / page_size) must not overflow. Only 8 token slots of
  // a page can be addressed (tokens 8 < page_size), so the in-page extent is min(8, page_size).
  l = kvc::PagedLayout{
      {1, 1, 8, 4}, std::numeric_limits<Index>::max(), 64, 4, 4, table.data(), 1, nullptr, nullptr, 4, 0};
  std::vector<Index> lengths = {7};
  CHECK(kvc::validate_rows(Rows(pool.data(), l), {}, lengths.data()).ok());
}

TEST_CASE("validate: an empty token dimension is valid, never overlapping rows", "[core][validate]") {
  std::vector<float> k(64), v(64);
  // bhtd strides of an empty cache are all zero: heads 4 at stride 0 is not an overlap when there is no row.
  for (kvc::KVExtents const e : {kvc::KVExtents{2, 4, 0, 8}, kvc::KVExtents{0, 4, 6, 8}, kvc::KVExtents{2, 0, 6, 8}}) {
    kvc::StridedLayout const l{e, 0, 0, 0};
    CAPTURE(e.batch, e.heads, e.tokens);
    CHECK(kvc::validate_rows(kvc::TokenRows<float, kvc::StridedLayout>(k.data(), l)).ok());
    CHECK(kvc::validate(kvc::dense_cache(k.data(), v.data(), e)).ok());
    CHECK(kvc::validate(kvc::dense_cache(k.data(), k.data(), e)).ok());  // no row: K and V share nothing
  }
  // A paged view of no token: a zero-size pool and zero in-page strides.
  kvc::PagedLayout const empty_paged{{2, 4, 0, 8}, 16, 0, 0, 0, nullptr, 0, nullptr, nullptr, 0, 0};
  std::vector<std::int32_t> indptr = {0, 0, 0};
  auto csr = empty_paged;
  csr.page_indptr = indptr.data();
  csr.page_indices = indptr.data();
  CHECK(kvc::validate_rows(kvc::TokenRows<float, kvc::PagedLayout>(k.data(), csr)).ok());
  CHECK(kvc::validate_rows(kvc::TokenRows<float, kvc::PagedLayout>(k.data(), empty_paged)).code() ==
        Errc::invalid_argument);  // block-table mode still needs a table
  // Non-empty views with a zero stride still overlap.
  kvc::StridedLayout const zero{{1, 4, 1, 8}, 0, 0, 8};
  CHECK(kvc::validate_rows(kvc::TokenRows<float, kvc::StridedLayout>(k.data(), zero)).message() ==
        std::string("StridedLayout: rows overlap (a stride is smaller than the block inside it)"));
}

TEST_CASE("validate: paged K and V in one pool must not overlap, interleaved pages are fine", "[core][validate]") {
  kvc::KVExtents const e{2, 2, 8, 4};  // page size 4: [page, heads, dim] = 32 elements a page
  Index const page = 4, block = page * e.heads * e.dim, pages = 4;
  std::vector<std::int32_t> table = {0, 1, 2, 3};
  using Rows = kvc::TokenRows<float, kvc::PagedLayout>;
  // Separate pools for K and V, and K and V in one pool: K's pages and V's pages share page ids.
  std::vector<float> pool(static_cast<std::size_t>(2 * pages * block));
  auto const l = kvc::paged_layout(e, page, kvc::PageOrder::nhd, table.data(), 2, pages);
  CHECK(kvc::validate(kvc::make_cache(Rows(pool.data(), l), Rows(pool.data() + pages * block, l))).ok());
  CHECK(kvc::validate(kvc::make_cache(Rows(pool.data(), l), Rows(pool.data(), l))).message() ==
        std::string("kvc::validate: K and V memory overlap"));
  // V's pool starts one page into K's: the address ranges overlap.
  CHECK(kvc::validate(kvc::make_cache(Rows(pool.data(), l), Rows(pool.data() + block, l))).code() ==
        Errc::invalid_argument);
  CHECK(kvc::validate(kvc::make_cache(Rows(pool.data() + block, l), Rows(pool.data(), l))).code() ==
        Errc::invalid_argument);
  // FlashInfer's [num_pages, 2, page_size, heads, dim]: stride_page covers K's page block then V's.
  auto inter = l;
  inter.stride_page = 2 * block;
  Rows const kf(pool.data(), inter), vf(pool.data() + block, inter);
  CHECK(kvc::validate(kvc::make_cache(kf, vf)).ok());
  CHECK(kvc::validate(kvc::make_cache(vf, kf)).ok());  // V's block first, K in the gap after it
  // V shifted by one element: its page block runs into the next page's K block.
  CHECK(kvc::validate(kvc::make_cache(kf, Rows(pool.data() + block + 1, inter))).code() == Errc::invalid_argument);
  // ... or into K's own block.
  CHECK(kvc::validate(kvc::make_cache(kf, Rows(pool.data() + block - 4, inter))).code() == Errc::invalid_argument);
  // Different strides (V's pool not interleaved the same way) fall back to address ranges: overlapping.
  auto other = inter;
  other.stride_page = 3 * block;
  CHECK(kvc::validate(kvc::make_cache(kf, Rows(pool.data() + block, other))).code() == Errc::invalid_argument);
  // A packed K||V row inside a page ([pages, page, heads, dk + dv]) is the row-level rule on a pool.
  kvc::KVExtents const half_dim{2, 2, 8, 2};
  auto packed = kvc::paged_layout(half_dim, page, kvc::PageOrder::nhd, table.data(), 2, pages);
  packed.stride_h = 4;
  packed.stride_t = 8;
  packed.stride_page = block;
  CHECK(kvc::validate(kvc::make_cache(Rows(pool.data(), packed), Rows(pool.data() + 2, packed))).ok());
  CHECK(kvc::validate(kvc::make_cache(Rows(pool.data(), packed), Rows(pool.data() + 1, packed))).code() ==
        Errc::invalid_argument);
}

TEST_CASE("validate: strided K and V blocks interleaved per head are disjoint", "[core][validate]") {
  // [B, H, 2, N, d]: each head holds its K block then its V block.
  kvc::KVExtents const e{2, 3, 5, 4};
  std::vector<float> buf(static_cast<std::size_t>(e.rows() * e.dim * 2));
  kvc::StridedLayout const l{e, e.heads * 2 * e.tokens * e.dim, 2 * e.tokens * e.dim, e.dim};
  using Rows = kvc::TokenRows<float, kvc::StridedLayout>;
  Index const kv = e.tokens * e.dim;
  CHECK(kvc::validate(kvc::make_cache(Rows(buf.data(), l), Rows(buf.data() + kv, l))).ok());
  CHECK(kvc::validate(kvc::make_cache(Rows(buf.data(), l), Rows(buf.data() + kv - e.dim, l))).code() ==
        Errc::invalid_argument);
  CHECK(kvc::validate(kvc::make_cache(Rows(buf.data(), l), Rows(buf.data() + kv + e.dim, l))).code() ==
        Errc::invalid_argument);
}

TEST_CASE("validate: ragged K and V rows in the same memory overlap, packed K||V rows do not", "[core][validate]") {
  // Two heads of 3 and 2 rows (5 rows of d = 4): K and V must not share a row, or compaction moves one over the other.
  std::vector<Index> const offsets = {0, 3, 5};
  kvc::RaggedShape const shape{5, 3};
  std::vector<float> buf(2 * 5 * 4);
  auto ragged = [&](float* k, float* v) {
    return kvc::ragged_cache(k, v, 1, 2, 4, 4, shape, offsets.data(), kvc::Lengths{});
  };
  CHECK(kvc::validate(ragged(buf.data(), buf.data() + 20)).ok());  // disjoint halves of one buffer
  CHECK(kvc::validate(ragged(buf.data(), buf.data())).message() ==
        std::string("kvc::validate: K and V memory overlap"));
  CHECK(kvc::validate(ragged(buf.data(), buf.data() + 16)).code() == Errc::invalid_argument);  // V's row 0 = K's row 4
  CHECK(kvc::validate(ragged(buf.data() + 16, buf.data())).code() == Errc::invalid_argument);
  // Packed K||V rows ([rows, 4 + 4]): V at K + 4 in every row, rows 8 apart, interleave without touching.
  auto packed = [&](Index v_offset) {
    kvc::RaggedLayout const l{{1, 2, 3, 4}, 8, offsets.data()};
    using Rows = kvc::TokenRows<float, kvc::RaggedLayout>;
    return kvc::make_cache(Rows(buf.data(), l), Rows(buf.data() + v_offset, l));
  };
  CHECK(kvc::validate(packed(4)).ok());
  CHECK(kvc::validate(packed(3)).code() == Errc::invalid_argument);
}

TEST_CASE("validate: per-head paged K and V lists naming the same pages of one pool overlap", "[core][validate]") {
  // Pool of 4 pages of 2 rows (d = 4); 2 heads with one page each.
  Index const ps = 2, d = 4, pages = 4;
  std::vector<float> pool(static_cast<std::size_t>(2 * pages * ps * d));
  std::vector<std::int32_t> const k_table = {0, 1}, v_same = {0, 1}, v_other = {2, 3};
  using Rows = kvc::TokenRows<float, kvc::HeadPagedLayout>;
  auto cache = [&](std::vector<std::int32_t> const& v_table, float* v_pool) {
    return kvc::make_cache(Rows(pool.data(), kvc::head_paged_layout(1, 2, d, ps, k_table.data(), 1, pages)),
                           Rows(v_pool, kvc::head_paged_layout(1, 2, d, ps, v_table.data(), 1, pages)));
  };
  CHECK(kvc::validate(cache(v_same, pool.data() + pages * ps * d)).ok());  // a pool each
  CHECK(kvc::validate(cache(v_same, pool.data())).message() == std::string("kvc::validate: K and V memory overlap"));
  // One pool, disjoint page ids: the views still address the whole pool (any id in [0, num_pages)), so the pools
  // overlap, as for PagedLayout.
  CHECK(kvc::validate(cache(v_other, pool.data())).code() == Errc::invalid_argument);
  // K and V pages interleaved in one pool (stride_page covers a K page then a V page) are disjoint.
  auto inter = kvc::head_paged_layout(1, 2, d, ps, k_table.data(), 1, pages);
  inter.stride_page = 2 * ps * d;
  CHECK(kvc::validate(kvc::make_cache(Rows(pool.data(), inter), Rows(pool.data() + ps * d, inter))).ok());
  CHECK(kvc::validate(kvc::make_cache(Rows(pool.data(), inter), Rows(pool.data() + ps * d - 1, inter))).code() ==
        Errc::invalid_argument);
}

TEST_CASE("validate_rows: lengths beyond the capacity or negative are rejected", "[core][validate]") {
  auto c = kvc::tools::HostCache<float>::random({2, 2, 6, 4}, 6);
  auto const rows = c.view().keys;
  std::vector<Index> lengths = {6, 7};
  CHECK(kvc::validate_rows(rows, {}, lengths.data()).message() ==
        std::string("kvc::validate: every valid length must be in [0, tokens]"));
  lengths = {6, -1};
  CHECK(kvc::validate_rows(rows, {}, lengths.data()).code() == Errc::invalid_argument);
  lengths = {6, 0};
  CHECK(kvc::validate_rows(rows, {}, lengths.data()).ok());
  std::vector<Index> per_head = {6, 6, 0, 7};
  CHECK(kvc::validate_rows(rows, {}, kvc::head_lengths(per_head.data(), 2)).code() == Errc::invalid_argument);
  // Paged: a length past the capacity is caught before any page id is read for it.
  std::vector<std::int32_t> table = {0, 1, 2, 3};
  std::vector<float> pool(4 * 2 * 2 * 4);
  auto const l = kvc::paged_layout({2, 2, 4, 4}, 2, kvc::PageOrder::nhd, table.data(), 2, 4);
  lengths = {4, 1000};
  CHECK(kvc::validate_rows(kvc::TokenRows<float, kvc::PagedLayout>(pool.data(), l), {}, lengths.data()).message() ==
        std::string("kvc::validate: every valid length must be in [0, tokens]"));
}

namespace {

/// validate(..., {.check_range = true}) of a one-row cache of head dim `dim` holding `x` in one K element.
template <class T>
kvc::Status range_of(float x, Index dim = 128) {
  std::vector<T> k(static_cast<std::size_t>(dim), T(0.5f)), v(k.size(), T(0.5f));
  k[static_cast<std::size_t>(dim / 2)] = T(x);
  return kvc::validate(kvc::dense_cache(k.data(), v.data(), {1, 1, 1, dim}), {.check_range = true});
}

}  // namespace

TEST_CASE("validate: check_range bounds dim * x^2 below 2^126 and implies the finite check", "[core][validate]") {
  CHECK(range_of<float>(1e17f).ok());
  CHECK(range_of<float>(-1e17f).ok());
  CHECK(range_of<float>(1e20f).code() == Errc::invalid_argument);
  CHECK(range_of<float>(-1e20f).code() == Errc::invalid_argument);
  CHECK(range_of<kvc::bfloat16>(1e17f).ok());
  CHECK(range_of<kvc::bfloat16>(1e19f).code() == Errc::invalid_argument);
  // The bound at d = 128 is 2^59.5: 2^59 passes, 2^60 does not; at d = 1 it is 2^63.
  CHECK(range_of<float>(0x1p59f).ok());
  CHECK(range_of<float>(0x1p60f).code() == Errc::invalid_argument);
  CHECK(range_of<float>(0x1p60f, 1).ok());
  CHECK(range_of<float>(0x1p63f, 1).code() == Errc::invalid_argument);
  CHECK(range_of<float>(std::numeric_limits<float>::max()).code() == Errc::invalid_argument);
  CHECK(range_of<float>(std::numeric_limits<float>::quiet_NaN()).code() == Errc::non_finite);
  CHECK(range_of<float>(std::numeric_limits<float>::infinity()).code() == Errc::non_finite);
  CHECK(range_of<kvc::bfloat16>(std::numeric_limits<float>::infinity()).code() == Errc::non_finite);
  // Without the option 1e20 is a valid value; check_finite alone does not bound it.
  std::vector<float> k(128, 1e20f), v(128, 0.0f);
  auto const c = kvc::dense_cache(k.data(), v.data(), {1, 1, 1, 128});
  CHECK(kvc::validate(c).ok());
  CHECK(kvc::validate(c, {.check_finite = true}).ok());
  CHECK(kvc::validate(c, {.check_range = true}).code() == Errc::invalid_argument);
  // V is checked too, and validate_rows runs the same scan; padding past the length is not read.
  std::vector<Index> len = {0};
  CHECK(kvc::validate(kvc::dense_cache(v.data(), k.data(), {1, 1, 1, 128}), {.check_range = true}).code() ==
        Errc::invalid_argument);
  CHECK(kvc::validate_rows(kvc::bhtd_rows(k.data(), {1, 1, 1, 128}), {.check_range = true}).code() ==
        Errc::invalid_argument);
  CHECK(kvc::validate_rows(kvc::bhtd_rows(k.data(), {1, 1, 1, 128}), {.check_range = true}, len.data()).ok());
}

TEST_CASE("validate: check_range accepts every finite fp16 value at head dim 128", "[core][validate]") {
  Index const dim = 128;
  std::vector<kvc::half> k(static_cast<std::size_t>(0x10000)), v(k.size(), kvc::half(0.0f));
  Index finite = 0;
  for (std::uint32_t b = 0; b < 0x10000u; ++b)
    if ((b & 0x7c00u) != 0x7c00u)  // skip Inf and NaN
      k[static_cast<std::size_t>(finite++)] = kvc::half::from_bits(static_cast<std::uint16_t>(b));
  for (Index i = finite; i < 0x10000; ++i)
    k[static_cast<std::size_t>(i)] = kvc::half(65504.0f);  // the largest finite value fills the tail
  kvc::KVExtents const e{1, 1, 0x10000 / dim, dim};
  CHECK(finite == 0x10000 - 2 * 0x400);
  CHECK(kvc::validate(kvc::dense_cache(k.data(), v.data(), e), {.check_range = true}).ok());
  k[5] = kvc::half::from_bits(0x7c00u);  // +Inf
  CHECK(kvc::validate(kvc::dense_cache(k.data(), v.data(), e), {.check_range = true}).code() == Errc::non_finite);
}

namespace {

/// A user-defined layout (any TokenLayout): validate checks its extents, not its rows.
struct FlatLayout {
  kvc::KVExtents ext;
  constexpr Index offset(Index b, Index h, Index t) const noexcept {
    return ((b * ext.heads + h) * ext.tokens + t) * ext.dim;
  }
};

}  // namespace

TEST_CASE("validate: a user-defined layout is checked for extents only", "[core][validate]") {
  std::vector<float> k(64), v(64);
  using Rows = kvc::TokenRows<float, FlatLayout>;
  CHECK(kvc::validate(kvc::make_cache(Rows(k.data(), {{1, 2, 4, 4}}), Rows(v.data(), {{1, 2, 4, 4}}))).ok());
  CHECK(kvc::validate(kvc::make_cache(Rows(k.data(), {{1, 2, 4, 0}}), Rows(v.data(), {{1, 2, 4, 0}}))).code() ==
        Errc::invalid_argument);
}
