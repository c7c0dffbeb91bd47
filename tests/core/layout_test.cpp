// SPDX-License-Identifier: Apache-2.0
// tests/core/layout_test.cpp mirrors include/kvc/core/layout.hpp: offsets, and paged/strided views scoring the
// same tokens identically.
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/core/layout.hpp>
#include <kvc/core/validate.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

using kvc::Index;

TEST_CASE("layout: BHTD and BTHD offsets (hand-computed)", "[core][layout]") {
  kvc::KVExtents const e{2, 3, 5, 4};
  auto const bhtd = kvc::bhtd_layout(e), bthd = kvc::bthd_layout(e);
  CHECK(bhtd.offset(1, 2, 3) == ((1 * 3 + 2) * 5 + 3) * 4);
  CHECK(bthd.offset(1, 2, 3) == ((1 * 5 + 3) * 3 + 2) * 4);
  CHECK(bhtd.offset(0, 0, 0) == 0);
}

TEST_CASE("layout: paged offsets for block tables and CSR, NHD and HND", "[core][layout]") {
  kvc::KVExtents const e{2, 2, 8, 4};
  std::vector<std::int32_t> table = {5, 1, 0, 3};  // [batch 2, max_pages 2], page size 4
  auto const nhd = kvc::paged_layout(e, 4, kvc::PageOrder::nhd, table.data(), 2, 6);
  auto const hnd = kvc::paged_layout(e, 4, kvc::PageOrder::hnd, table.data(), 2, 6);
  Index const page = 4 * 2 * 4;
  CHECK(nhd.offset(0, 1, 6) == 1 * page + 2 * (2 * 4) + 1 * 4);  // page 1, slot 2, head 1
  CHECK(hnd.offset(0, 1, 6) == 1 * page + 1 * (4 * 4) + 2 * 4);
  CHECK(nhd.offset(1, 0, 1) == 0 * page + 1 * 8);
  std::vector<std::int32_t> indptr = {0, 2, 4}, indices = table;
  auto const csr = kvc::paged_layout_csr(e, 4, kvc::PageOrder::nhd, indptr.data(), indices.data(), 4, 6);
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 2; ++h)
      for (Index t = 0; t < 8; ++t)
        CHECK(csr.offset(b, h, t) == nhd.offset(b, h, t));
}

TEST_CASE("layout: paged (pages out of order), BTHD and BHTD views give identical scores", "[core][layout]") {
  kvc::KVExtents const e{2, 3, 37, 16};  // 37 tokens: the last page is partial
  auto const dense = kvc::tools::HostCache<kvc::half>::random(e, 9);
  Index const page_size = 8, pages_per_seq = 5;
  std::vector<std::int32_t> table = {7, 2, 9, 0, 4, 1, 8, 3, 6, 5};  // shuffled page ids
  for (auto order : {kvc::PageOrder::nhd, kvc::PageOrder::hnd}) {
    auto const layout = kvc::paged_layout(e, page_size, order, table.data(), pages_per_seq, 10);
    std::vector<kvc::half> pool(static_cast<std::size_t>(10 * layout.stride_page));
    std::vector<kvc::half> bthd(dense.k.size());
    auto const bthd_layout = kvc::bthd_layout(e);
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h)
        for (Index t = 0; t < e.tokens; ++t)
          for (Index i = 0; i < e.dim; ++i) {
            kvc::half const x = dense.k[static_cast<std::size_t>(kvc::bhtd_layout(e).offset(b, h, t) + i)];
            pool[static_cast<std::size_t>(layout.offset(b, h, t) + i)] = x;
            bthd[static_cast<std::size_t>(bthd_layout.offset(b, h, t) + i)] = x;
          }
    kvc::TokenRows<kvc::half const, kvc::PagedLayout> const paged_rows(pool.data(), layout);
    kvc::TokenRows<kvc::half const, kvc::StridedLayout> const bthd_rows(bthd.data(), bthd_layout);
    auto const paged = kvc::make_cache(paged_rows, paged_rows);
    auto const strided = kvc::make_cache(bthd_rows, bthd_rows);
    kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::KeyDiffScorer{}, e));
    kvc::test::OwnedScores a(2, 3, 37), b(2, 3, 37), c(2, 3, 37), d(2, 3, 37);
    REQUIRE(kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, dense.view(), a.span, ws.get()).ok());
    REQUIRE(kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, paged, b.span, ws.get()).ok());
    REQUIRE(kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, strided, c.span, ws.get()).ok());
    REQUIRE(kvc::score(kvc::Cpu{}, kvc::KnormScorer{}, paged, d.span, ws.get()).ok());
    CHECK(a.data == b.data);
    CHECK(a.data == c.data);
    CHECK(d.data[0] < 0.0f);
  }
}

TEST_CASE("layout: extents whose element count overflows 64 bits give a refused view, not a signed overflow",
          "[core][layout]") {
  // [1, 2^30, 2^30, 128] holds 2^67 elements: heads * tokens * dim, the BHTD batch stride, overflows int64.
  Index const big = Index{1} << 30;
  kvc::KVExtents const e{1, big, big, 128};
  float k = 0.0f, v = 0.0f;  // never read: every check refuses the extents first
  auto const dense = kvc::dense_cache(&k, &v, e);
  CHECK(dense.keys.layout().stride_b == std::numeric_limits<Index>::max());  // saturated
  kvc::Status st = kvc::validate(dense);
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("overflows 64 bits") != std::string::npos);
  auto const bthd = kvc::make_cache(kvc::TokenRows<float, kvc::StridedLayout>(&k, kvc::bthd_layout(e)),
                                    kvc::TokenRows<float, kvc::StridedLayout>(&v, kvc::bthd_layout(e)));
  CHECK(kvc::validate(bthd).code() == kvc::Errc::invalid_argument);
  // An entry point refuses them too, before its kernel multiplies anything.
  std::vector<float> out(4);
  st = kvc::score(kvc::Cpu{}, kvc::KnormScorer{}, dense, kvc::ScoreSpan<>{out.data(), 1, big, big}, {});
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("kvc::score: the cache has a negative extent") != std::string::npos);
  // Paged: page_size * heads * dim (the page stride of a 2-page pool) overflows; per-head paged: max_pages *
  // page_size (its token capacity).
  std::int32_t table = 0;
  auto const paged = kvc::paged_layout({1, 2, 8, 128}, Index{1} << 60, kvc::PageOrder::nhd, &table, 1, 2);
  CHECK(kvc::validate_rows(kvc::TokenRows<float, kvc::PagedLayout>(&k, paged)).code() == kvc::Errc::invalid_argument);
  auto const per_head = kvc::head_paged_layout(1, 2, 128, Index{1} << 40, &table, big, 1);
  CHECK(per_head.ext.tokens == std::numeric_limits<Index>::max());
  CHECK(kvc::validate_rows(kvc::TokenRows<float, kvc::HeadPagedLayout>(&k, per_head)).code() ==
        kvc::Errc::invalid_argument);
}
