// SPDX-License-Identifier: Apache-2.0
// tests/core/layout_test.cpp mirrors include/kvc/core/layout.hpp: offsets, and paged/strided views scoring the
// same tokens identically.
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/core/layout.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <cstdint>
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
