// SPDX-License-Identifier: Apache-2.0
// tests/store/ragged_test.cpp mirrors include/kvc/store/ragged.hpp: ragged and per-head paged stores filled by
// gather, grown by append (original_baselines.md §5.3's layout example), compacted in place, attended (ragged ==
// masked uniform for the same kept sets), reported, validated, and driven by the decode driver with AdaKV.
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/pipeline/decode.hpp>
#include <kvc/store/ragged.hpp>

#include "common/ragged_store.hpp"
#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

using kvc::Index;

namespace {

/// A plan whose head i keeps `counts[i]` slots: every other slot from slot i % 2.
kvc::test::OwnedPlan strided_plan(Index batch, Index heads, Index capacity, std::vector<Index> const& counts) {
  kvc::test::OwnedPlan plan(batch, heads, capacity);
  for (Index i = 0; i < batch * heads; ++i) {
    plan.count[static_cast<std::size_t>(i)] = counts[static_cast<std::size_t>(i)];
    for (Index j = 0; j < counts[static_cast<std::size_t>(i)]; ++j)
      plan.index[static_cast<std::size_t>(i * capacity + j)] = i % 2 + 2 * j;
  }
  return plan;
}

template <class T>
bool same_row(T const* a, T const* b, Index d) {
  return std::memcmp(a, b, static_cast<std::size_t>(d) * sizeof(T)) == 0;
}

}  // namespace

TEST_CASE("ragged_offsets: the exclusive prefix sum of counts plus reserve (§5.3's example)") {
  std::vector<Index> const counts{3, 1, 2};
  std::vector<Index> offsets(4);
  kvc::RaggedShape shape;
  REQUIRE(kvc::ragged_offsets(counts.data(), 3, 0, offsets.data(), shape).ok());
  CHECK(offsets == std::vector<Index>{0, 3, 4, 6});
  CHECK((shape.rows == 6 && shape.max_capacity == 3));
  REQUIRE(kvc::ragged_offsets(counts.data(), 3, 1, offsets.data(), shape).ok());
  CHECK(offsets == std::vector<Index>{0, 4, 6, 9});
  std::vector<Index> const bad{3, -1, 2};
  CHECK(kvc::ragged_offsets(bad.data(), 3, 0, offsets.data(), shape).code() == kvc::Errc::invalid_argument);
  CHECK(kvc::ragged_offsets(counts.data(), 3, -1, offsets.data(), shape).code() == kvc::Errc::invalid_argument);
}

TEST_CASE("ragged store: §5.3's decode append moves head h to cu[h] + h and writes its token at cu[h+1] + h") {
  // Three heads holding 3, 1 and 2 tokens (rows tagged by head and slot), then one new token each.
  Index const d = 2;
  std::vector<Index> const counts{3, 1, 2};
  kvc::tools::HostRaggedStore<float> store(1, 3, d, d, counts.data(), 0);
  for (Index h = 0; h < 3; ++h)
    for (Index t = 0; t < counts[static_cast<std::size_t>(h)]; ++t) {
      float* k = store.view().keys.row(0, h, t);
      k[0] = static_cast<float>(h);
      k[1] = static_cast<float>(t);
      store.view().values.row(0, h, t)[0] = static_cast<float>(10 * h + t);
      store.view().position_ref(0, h, t) = 5 * t;
      store.lengths[static_cast<std::size_t>(h)] = t + 1;
    }
  REQUIRE(kvc::validate(store.view()).ok());
  kvc::tools::HostCache<float> token({1, 3, 1, d});
  for (Index h = 0; h < 3; ++h)
    token.key(0, h, 0)[0] = 100.0f + static_cast<float>(h);
  token.positions = {40, 41, 42};
  // The store is full: appending to it is refused before anything changes.
  CHECK(kvc::append(kvc::Cpu{}, store.view(), token.view()).code() == kvc::Errc::out_of_capacity);
  CHECK(store.lengths == counts);
  auto grown = kvc::tools::relayout(store, 1);
  CHECK(grown.offsets == std::vector<Index>{0, 4, 6, 9});
  REQUIRE(kvc::append(kvc::Cpu{}, grown.view(), token.view()).ok());
  CHECK(grown.lengths == std::vector<Index>{4, 2, 3});
  // Flat rows: head 0 at 0..2 and its new token at 3; head 1 at 4, new at 5; head 2 at 6..7, new at 8.
  std::vector<float> const expect_tag{0, 0, 0, 100, 1, 101, 2, 2, 102};
  for (std::size_t r = 0; r < 9; ++r)
    CHECK(grown.k[r * d] == expect_tag[r]);
  CHECK(grown.positions == std::vector<Index>{0, 5, 10, 40, 0, 41, 0, 5, 42});
  CHECK(grown.v[7 * d] == 21.0f);
  REQUIRE(kvc::validate(grown.view()).ok());
}

TEST_CASE("ragged store: gather from a uniform cache keeps each head's own tokens, rows and positions") {
  kvc::KVExtents const e{2, 3, 20, 8};
  auto src = kvc::tools::HostCache<kvc::half>::random(e, 11);
  src.track(20);
  for (std::size_t i = 0; i < src.positions.size(); ++i)
    src.positions[i] += 7;  // positions differ from slots
  std::vector<Index> const counts{5, 1, 9, 0, 3, 10};
  auto plan = strided_plan(2, 3, 20, counts);
  kvc::tools::HostRaggedStore<kvc::half> store(2, 3, 8, 8, counts.data(), 2);
  REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, src.view(), store.view()).ok());
  CHECK(store.lengths == counts);
  REQUIRE(kvc::validate(store.view()).ok());
  for (Index b = 0; b < 2; ++b)
    for (Index h = 0; h < 3; ++h)
      for (Index j = 0; j < counts[static_cast<std::size_t>(b * 3 + h)]; ++j) {
        Index const from = plan.plan.indices(b, h)[j];
        CHECK(same_row(store.view().keys.row(b, h, j), src.key(b, h, from), 8));
        CHECK(same_row(store.view().values.row(b, h, j), src.v.data() + ((b * 3 + h) * 20 + from) * 8, 8));
        CHECK(store.view().position(b, h, j) == from + 7);
      }
  // The memory: exactly the kept rows plus the reserve, against the uniform cache padded to the longest head.
  kvc::StoreReport const r = kvc::store_report(store.view());
  CHECK(r.row_bytes == 8 * 2 + 8 * 2 + 8);
  CHECK(r.used_bytes == 28 * r.row_bytes);
  CHECK(r.held_bytes == (28 + 6 * 2) * r.row_bytes);
  CHECK(r.uniform_bytes == (3 * 9 + 3 * 10) * r.row_bytes);
  // A head whose segment is shorter than its count is refused before anything is written.
  std::vector<Index> const small{5, 1, 8, 0, 3, 10};
  kvc::tools::HostRaggedStore<kvc::half> tight(2, 3, 8, 8, small.data(), 0);
  CHECK(kvc::gather(kvc::Cpu{}, plan.plan, src.view(), tight.view()).code() == kvc::Errc::out_of_capacity);
  CHECK(tight.lengths == std::vector<Index>(6, 0));
}

TEST_CASE("ragged store: attention equals the uniform cache's for the same kept sets (GQA)") {
  kvc::KVExtents const e{2, 2, 24, 16};
  auto uni = kvc::tools::HostCache<kvc::bfloat16>::random(e, 3);
  uni.track(24);
  std::vector<Index> const counts{7, 11, 1, 12};
  auto plan = strided_plan(2, 2, 24, counts);
  kvc::tools::HostRaggedStore<kvc::bfloat16> store(2, 2, 16, 16, counts.data(), 3);
  REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, uni.view(), store.view()).ok());
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, uni.view()).ok());  // the uniform cache, masked by its lengths
  Index const hq = 6, n = 3;
  auto const q = kvc::tools::random_values<float>(2 * hq * n * 16, 5, 1.0f);
  std::vector<Index> const qpos{46, 47, 48, 30, 31, 60};
  kvc::AttendQueries<float> const queries{kvc::bhtd_rows(q.data(), {2, hq, n, 16}), qpos.data()};
  auto attend = [&](auto const& cache) {
    std::vector<float> out(static_cast<std::size_t>(2 * hq * n * 16)), lse(static_cast<std::size_t>(2 * hq * n));
    kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, queries, cache));
    REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, cache, {out.data(), lse.data()}, ws.get()).ok());
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  CHECK(attend(store.view()) == attend(uni.view()));
}

TEST_CASE("ragged store: in-place compaction and scoring match the uniform cache") {
  kvc::KVExtents const e{1, 4, 32, 8};
  auto uni = kvc::tools::HostCache<float>::random(e, 9);
  uni.track(32);
  auto first = strided_plan(1, 4, 32, std::vector<Index>{16, 12, 16, 16});
  for (Index j = 0; j < 16; ++j)  // head 0 and 3: the first 16 slots; heads 1 and 2 strided (within 32)
    first.index[static_cast<std::size_t>(j)] = first.index[static_cast<std::size_t>(3 * 32 + j)] = j;
  kvc::tools::HostRaggedStore<float> store(1, 4, 8, 8, std::vector<Index>{16, 12, 16, 16}.data(), 4);
  REQUIRE(kvc::gather(kvc::Cpu{}, first.plan, uni.view(), store.view()).ok());
  REQUIRE(kvc::compact(kvc::Cpu{}, first.plan, uni.view()).ok());
  // Both score with KeyDiff and select the same per-head budgets, then compact in place.
  kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}}};
  auto compress = [&](auto const& cache, kvc::KVExtents ext) {
    kvc::test::OwnedPlan plan(1, 4, ext.tokens);
    kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, ext));
    REQUIRE(kvc::compress(kvc::Cpu{}, press, cache, plan.plan, ws.get()).ok());
    REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache).ok());
    return plan;
  };
  compress(uni.view(), uni.ext);
  compress(store.view(), store.view().keys.extents());
  CHECK(store.lengths == uni.lengths);
  for (Index h = 0; h < 4; ++h)
    for (Index j = 0; j < store.lengths[static_cast<std::size_t>(h)]; ++j) {
      CHECK(same_row(store.view().keys.row(0, h, j), uni.key(0, h, j), 8));
      CHECK(store.view().position(0, h, j) == uni.view().position(0, h, j));
    }
}

TEST_CASE("per-head paged store: each head's own page list, attention equal, pages freed per head") {
  Index const d = 8, ps = 4, heads = 2, max_pages = 4, pool = 8;
  kvc::KVExtents const e{1, heads, 16, d};
  auto uni = kvc::tools::HostCache<float>::random(e, 21);
  uni.track(16);
  // Head 0 owns pages 5, 1, 6, 2; head 1 owns 0, 7, 3, 4 (scrambled, as an allocator hands them out).
  std::vector<std::int32_t> const table{5, 1, 6, 2, 0, 7, 3, 4};
  std::vector<float> kpool(static_cast<std::size_t>(pool * ps * d)), vpool(kpool.size());
  std::vector<Index> lengths(heads, 0), positions(static_cast<std::size_t>(pool * ps));
  auto const layout = kvc::head_paged_layout(1, heads, d, ps, table.data(), max_pages, pool);
  auto const paged = kvc::make_cache(kvc::TokenRows<float, kvc::HeadPagedLayout>(kpool.data(), layout),
                                     kvc::TokenRows<float, kvc::HeadPagedLayout>(vpool.data(), layout),
                                     kvc::head_lengths(lengths.data(), heads), positions.data());
  REQUIRE(kvc::validate(paged).ok());
  REQUIRE(kvc::append(kvc::Cpu{}, paged, uni.view()).ok());
  REQUIRE(kvc::validate(paged).ok());
  CHECK(same_row(paged.keys.row(0, 1, 5), uni.key(0, 1, 5), d));
  CHECK(paged.keys.row(0, 1, 5) == kpool.data() + (7 * ps + 1) * d);  // head 1's second page is pool page 7
  auto plan = strided_plan(1, heads, 16, {3, 7});
  std::vector<Index> pages(heads);
  kvc::PageReport const report = kvc::head_page_report(plan.plan, paged, pages.data());
  CHECK((report.pages_before == 8 && report.pages_after == 3 && report.pages_freed() == 5));
  CHECK(pages == std::vector<Index>{1, 2});
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, paged).ok());
  REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, uni.view()).ok());
  kvc::StoreReport const mem = kvc::store_report(paged);
  CHECK(mem.held_bytes == 3 * ps * mem.row_bytes);
  std::vector<float> const q = kvc::tools::random_values<float>(4 * 2 * d, 8, 1.0f);
  kvc::AttendQueries<float> const queries{kvc::bhtd_rows(q.data(), {1, 4, 2, d})};
  auto attend = [&](auto const& cache) {
    std::vector<float> out(static_cast<std::size_t>(4 * 2 * d));
    kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, queries, cache));
    REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, cache, {out.data(), nullptr}, ws.get()).ok());
    return out;
  };
  CHECK(attend(paged) == attend(uni.view()));
}

TEST_CASE("ragged and per-head paged layouts: validation names what is wrong") {
  std::vector<float> k(64), v(64);
  std::vector<Index> lengths{2, 2};
  std::vector<Index> offsets{0, 3, 2};  // decreasing
  kvc::RaggedShape const shape{4, 3};
  auto bad =
      kvc::ragged_cache(k.data(), v.data(), 1, 2, 4, 4, shape, offsets.data(), kvc::head_lengths(lengths.data(), 2));
  CHECK(kvc::validate(bad).code() == kvc::Errc::invalid_argument);
  offsets = {0, 3, 5};
  lengths = {2, 3};  // head 1's segment holds 2
  auto const too_long =
      kvc::ragged_cache(k.data(), v.data(), 1, 2, 4, 4, shape, offsets.data(), kvc::head_lengths(lengths.data(), 2));
  CHECK(std::string(kvc::validate(too_long).message()).find("segment") != std::string::npos);
  lengths = {2, 2};
  std::vector<Index> other{0, 2, 5};
  auto mixed = kvc::make_cache(
      kvc::TokenRows<float, kvc::RaggedLayout>(k.data(), kvc::ragged_layout(1, 2, 4, 3, offsets.data())),
      kvc::TokenRows<float, kvc::RaggedLayout>(v.data(), kvc::ragged_layout(1, 2, 4, 3, other.data())),
      kvc::head_lengths(lengths.data(), 2));
  CHECK(std::string(kvc::validate(mixed).message()).find("same") != std::string::npos);
  std::vector<std::int32_t> table{0, 9};  // page 9 is outside a pool of 4
  auto const layout = kvc::head_paged_layout(1, 2, 4, 2, table.data(), 1, 4);
  auto paged = kvc::make_cache(kvc::TokenRows<float, kvc::HeadPagedLayout>(k.data(), layout),
                               kvc::TokenRows<float, kvc::HeadPagedLayout>(v.data(), layout),
                               kvc::head_lengths(lengths.data(), 2));
  CHECK(std::string(kvc::validate(paged).message()).find("pool") != std::string::npos);
}

TEST_CASE("decode driver on a ragged store with AdaKV: equal to the uniform cache, memory per head") {
  // Prefill 48 tokens into both caches, then decode 24 tokens with a compression every 8 steps at an average of
  // 20 tokens per head: the ragged store (re-laid out after each compression) and the uniform cache hold the same
  // tokens and attend to the same outputs.
  Index const hkv = 2, hq = 4, d = 16, total = 72, prompt = 48;
  kvc::KVExtents const all{1, hkv, total, d};
  auto src = kvc::tools::HostCache<float>::random(all, 31);
  src.track(total);
  kvc::test::OwnedRope rope(kvc::RopeSpec{}, d, total + 8);
  auto const qsrc = kvc::tools::random_values<float>(hq * total * d, 32, 1.0f);
  kvc::DecodeSchedule sch;
  sch.compression_interval = 8;
  sch.hidden_states_buffer_size = 8;
  kvc::SnapKVScorer scorer;
  scorer.window_size = 4;
  auto const selector = kvc::AdaKVSelector{kvc::FixedBudget{20}, 0.2, kvc::Reference::authors, 0, 4};

  kvc::tools::HostCache<float> uni({1, hkv, total, d});
  uni.track(0);
  std::vector<Index> const full(hkv, 0);
  kvc::tools::HostRaggedStore<float> store(1, hkv, d, d, full.data(), prompt + 8);
  std::vector<float> qdata(static_cast<std::size_t>(hq * 8 * d));
  std::vector<Index> qpos(8);
  kvc::QueryBuffer<float> bu{qdata.data(), qpos.data(), 1, hq, 8, d}, br = bu;
  std::vector<float> qdata2(qdata.size());
  std::vector<Index> qpos2(8);
  br.data = qdata2.data();
  br.positions = qpos2.data();
  kvc::DecodeCounter cu, cr;
  REQUIRE(kvc::append(kvc::Cpu{}, uni.view(), src.view(), 0, prompt).ok());
  REQUIRE(kvc::append(kvc::Cpu{}, store.view(), src.view(), 0, prompt).ok());
  for (Index t = prompt; t < total; ++t) {
    if (store.lengths[0] == store.capacity(0, 0) || store.lengths[1] == store.capacity(0, 1))
      store = kvc::tools::relayout(store, 8);
    REQUIRE(kvc::append(kvc::Cpu{}, uni.view(), src.view(), t, 1).ok());
    REQUIRE(kvc::append(kvc::Cpu{}, store.view(), src.view(), t, 1).ok());
    for (auto* buf : {&bu, &br}) {
      for (Index q = 0; q < hq; ++q)
        std::copy_n(qsrc.data() + (q * total + t) * d, d, buf->row(0, q, buf->count));
      buf->positions[buf->count] = t;
      REQUIRE(buf->push(1).ok());
    }
    kvc::test::OwnedWorkspace wu(kvc::decode_workspace_bytes(kvc::Cpu{}, scorer, selector, sch, uni.ext, bu));
    REQUIRE(kvc::decode_step(kvc::Cpu{}, scorer, selector, sch, uni.view(), bu, cu, rope.table, wu.get()).ok());
    kvc::test::OwnedWorkspace wr(
        kvc::decode_workspace_bytes(kvc::Cpu{}, scorer, selector, sch, store.view().keys.extents(), br));
    bool compressed = false;
    REQUIRE(kvc::decode_step(kvc::Cpu{}, scorer, selector, sch, store.view(), br, cr, rope.table, wr.get(), &compressed)
                .ok());
    if (compressed)
      store = kvc::tools::relayout(store, 8);  // shrink to the kept tokens: the memory really goes
    REQUIRE(store.lengths == uni.lengths);
    for (Index h = 0; h < hkv; ++h)
      for (Index j = 0; j < uni.lengths[static_cast<std::size_t>(h)]; ++j)
        REQUIRE(store.view().position(0, h, j) == uni.view().position(0, h, j));
  }
  CHECK(cr.compressions == 3);
  CHECK(store.lengths[0] != store.lengths[1]);  // AdaKV gave the heads different budgets
  kvc::StoreReport const r = kvc::store_report(store.view());
  CHECK(r.held_bytes == (store.lengths[0] + store.lengths[1] + 2 * 8) * r.row_bytes);
}

TEST_CASE("ragged store: score, attend and compact check each length against its head's own segment") {
  // Segments of 3 and 2 rows (5 rows of d = 4, exactly sized buffers); head 1 claims 3 tokens: within ext.tokens = 3
  // but past its segment, so its third row would be read past the buffer. Every entry point refuses it.
  std::vector<float> k(5 * 4, 0.5f), v(5 * 4, 0.25f);
  std::vector<Index> offsets{0, 3, 5}, lengths{3, 3};
  kvc::RaggedShape const shape{5, 3};
  auto const cache =
      kvc::ragged_cache(k.data(), v.data(), 1, 2, 4, 4, shape, offsets.data(), kvc::head_lengths(lengths.data(), 2));
  std::string const message = "every valid length of the cache must be in [0, its head's capacity]";
  kvc::test::OwnedScores scores(1, 2, 3);
  kvc::test::OwnedWorkspace sws(kvc::score_workspace_bytes(kvc::Cpu{}, kvc::KeyDiffScorer{}, cache.keys.extents()));
  kvc::Status st = kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, cache, scores.span, sws.get());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find(message) != std::string::npos);
  std::vector<float> q(2 * 4, 1.0f), out(2 * 4);
  kvc::AttendQueries<float> const queries{{q.data(), kvc::bhtd_layout({1, 2, 1, 4})}};
  kvc::test::OwnedWorkspace aws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, queries, cache));
  st = kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, cache, {out.data()}, aws.get());
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find(message) != std::string::npos);
  auto const plan = kvc::test::plan_of(1, 2, 3, {{0, 2}, {0, 1}});
  st = kvc::compact(kvc::Cpu{}, plan.plan, cache);
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find(message) != std::string::npos);
  CHECK(lengths == std::vector<Index>{3, 3});
  // Within the segments, all three run.
  lengths = {3, 2};
  CHECK(kvc::score(kvc::Cpu{}, kvc::KeyDiffScorer{}, cache, scores.span, sws.get()).ok());
  CHECK(kvc::attend(kvc::Cpu{}, kvc::Attention{}, queries, cache, {out.data()}, aws.get()).ok());
  CHECK(kvc::compact(kvc::Cpu{}, plan.plan, cache).ok());
  CHECK(lengths == std::vector<Index>{2, 2});
}
