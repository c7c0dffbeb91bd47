// SPDX-License-Identifier: Apache-2.0
// tests/engine/fp8_cache_test.cpp mirrors include/kvc/core/access.hpp on the CPU: an fp8 cache (E4M3 and E5M2, a
// scale per (sequence, KV head)) read through its view's accessor by every policy's engine session (scorers,
// selection, compaction, append, attention, decode-time compression, packing) gives exactly what the same session
// gives on the dequantised fp32 cache: the same kept tokens, the same attention outputs bit for bit; and every scorer's
// scores equal bit for bit (the sessions alone would miss a scale a policy's ranking does not depend on). Built again
// with F16C + AVX2 and with AVX-512 (tests/CMakeLists.txt), whose kernels read fp8 through the hardware paths.
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/attention/corrected.hpp>
#include <kvc/backend/cpu/attention/merge.hpp>
#include <kvc/backend/cpu/attention/packed.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/pack.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/state.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/moment_kv.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/rdkv.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/scorers/uncomp.hpp>
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/backend/cpu/selectors/rdkv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/selectors/uncomp.hpp>
#include <kvc/engine/layer_compressor.hpp>

#include "support/catch.hpp"
#include "support/compressor_scenario.hpp"
#include "support/helpers.hpp"
#include "support/instructions.hpp"

#include <string>
#include <string_view>
#include <vector>

using kvc::Index;
using kvc::test::CacheFormat;
using kvc::test::HostMemory;
using kvc::test::Scenario;
using kvc::test::ScenarioResult;

namespace {

template <class CT>
ScenarioResult run(std::string const& name, Scenario const& sc) {
  HostMemory mem;
  ScenarioResult r;
  std::string const err =
      kvc::test::with_any_scenario_policy<kvc::HostSpace>(name, sc, mem, [&](auto const& policy, auto const& options) {
        return kvc::test::run_scenario<CT>(kvc::Cpu{}, mem, policy, options, sc, r);
      });
  INFO(name << ": " << err);
  REQUIRE(err.empty());
  return r;
}

template <class F8>
void check_equals_dequantised(CacheFormat format) {
  Scenario fp8;
  fp8.format = format;
  Scenario plain;  // the unquantised values: the fp8 cache must differ from them, or nothing was quantised
  for (std::string const& name : kvc::test::all_scenario_policies()) {
    INFO(name);
    ScenarioResult const q = run<F8>(name, fp8);
    ScenarioResult const d = run<float>(name, fp8);  // the dequantised fp32 cache
    CHECK(q.prefill_lengths == d.prefill_lengths);
    CHECK(q.prefill_positions == d.prefill_positions);
    CHECK(q.lengths == d.lengths);
    CHECK(q.positions == d.positions);
    CHECK(q.keys == d.keys);
    CHECK(q.attention == d.attention);  // bit for bit: every element is read as decode(byte) * scale
    CHECK(q.compressions == d.compressions);
    CHECK(q.moment_counts == d.moment_counts);
    CHECK(q.packed_tokens == d.packed_tokens);
    CHECK(q.packed_bits == d.packed_bits);
    CHECK(q.packed_keys == d.packed_keys);
    CHECK(q.packed_values == d.packed_values);
    CHECK(q.packed_positions == d.packed_positions);
    if (name == "streaming_llm")  // quantisation reached attention (one policy suffices; this can fail)
      CHECK(q.attention != run<float>(name, plain).attention);
  }
}

/// Scores of `scorer` over the scenario's prompt as a cache of element type CT (every head full: no length table),
/// with the prompt's last queries as window queries and their statistics (ExpectedAttention).
template <class CT, class S>
std::vector<float> prompt_scores(S const& scorer, Scenario const& sc) {
  kvc::KVExtents const e = sc.keys();
  std::vector<float> const k_scales = sc.k_scales(), v_scales = sc.v_scales();
  std::vector<CT> k = sc.stored<CT>(sc.prompt_keys(), k_scales), v = sc.stored<CT>(sc.prompt_values(), v_scales);
  auto access = [&](std::vector<float> const& scales) {
    if constexpr (kvc::is_fp8<CT>)
      return kvc::sequence_head_scales(scales.data(), e.heads);
    else
      return kvc::PlainAccess{};
  };
  auto const cache =
      kvc::make_cache(kvc::bhtd_rows(k.data(), e, access(k_scales)), kvc::bhtd_rows(v.data(), e, access(v_scales)));
  std::vector<float> const q = sc.prompt_queries();
  kvc::KVExtents const qe = sc.prompt_query_extents();
  kvc::TokenRows<float const, kvc::StridedLayout> const rows(q.data(), kvc::bhtd_layout(qe));
  kvc::test::OwnedScores out(e.batch, e.heads, e.tokens);
  kvc::Cpu const cpu;
  auto run = [&](auto const& obs) {
    kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(cpu, scorer, e, obs));
    REQUIRE(kvc::score(cpu, scorer, cache, obs, out.span, ws.get()).ok());
  };
  if constexpr (kvc::has_need(S::needs, kvc::Needs::query_statistics)) {
    std::vector<float> mean(static_cast<std::size_t>(qe.batch * qe.heads * qe.dim));
    std::vector<float> cov(mean.size() * static_cast<std::size_t>(qe.dim));
    kvc::test::OwnedWorkspace ws(kvc::query_statistics_workspace_bytes(cpu, qe));
    REQUIRE(kvc::query_statistics(cpu, rows, nullptr, kvc::StatisticsRows{}, mean.data(), cov.data(), ws.get()).ok());
    kvc::test::OwnedRope const rope(kvc::RopeSpec{}, e.dim, sc.rope_positions);
    run(kvc::observe(kvc::QueryStatistics<>{mean.data(), cov.data(), qe.batch, qe.heads, qe.dim, rope.table}));
  } else if constexpr (kvc::has_need(S::needs, kvc::Needs::window_queries)) {
    run(kvc::observe(kvc::WindowQueries<float>{rows}));
  } else {
    run(kvc::NoObservations{});
  }
  return out.data;
}

template <class F8>
void check_scores_equal_dequantised(CacheFormat format) {
  Scenario sc;
  sc.format = format;
  auto check = [&](char const* name, auto const& scorer) {
    INFO(name);
    std::vector<float> const q = prompt_scores<F8>(scorer, sc), d = prompt_scores<float>(scorer, sc);
    CHECK(q == d);
    Scenario plain;  // and the scale reached the scores: they differ from the unquantised cache's
    CHECK(q != prompt_scores<float>(scorer, plain));
  };
  check("knorm", kvc::KnormScorer{});
  check("key_diff", kvc::KeyDiffScorer{});
  check("key_diff raw mean", kvc::KeyDiffScorer{kvc::KeyDiffAnchor::raw_mean});
  check("snap_kv", kvc::SnapKVScorer{kvc::Reference::authors, sc.window});
  check("tova", kvc::TOVAScorer{});
  check("expected_attention", kvc::ExpectedAttentionScorer{});
  kvc::RDKVTokenScorer rdkv;
  rdkv.window_size = sc.window;
  check("rdkv tokens", rdkv);
}

}  // namespace

TEST_CASE("fp8 caches: every scorer's scores equal the dequantised fp32 cache's", "[engine][fp8]") {
  KVC_SKIP_WITHOUT_INSTRUCTIONS();
#if defined(KVC_EXPECT_F16_CONVERSION)  // a hardware build: its kernels really took the F16C path
  REQUIRE(std::string_view(kvc::detail::f16_conversion) == KVC_EXPECT_F16_CONVERSION);
#endif
  check_scores_equal_dequantised<kvc::float8_e4m3>(CacheFormat::e4m3);
  check_scores_equal_dequantised<kvc::float8_e5m2>(CacheFormat::e5m2);
}

TEST_CASE("fp8 caches: every policy's session equals the dequantised fp32 cache's (E4M3)", "[engine][fp8]") {
  KVC_SKIP_WITHOUT_INSTRUCTIONS();
  check_equals_dequantised<kvc::float8_e4m3>(CacheFormat::e4m3);
}

TEST_CASE("fp8 caches: every policy's session equals the dequantised fp32 cache's (E5M2)", "[engine][fp8]") {
  KVC_SKIP_WITHOUT_INSTRUCTIONS();
  check_equals_dequantised<kvc::float8_e5m2>(CacheFormat::e5m2);
}

namespace {
/// A host cache of element type CT (fp8 under per-(sequence, head) scales, or the values those read back) over
/// [B, H, N, d_k] keys and [B, H, N, d_v] values from the scenario's hash, with ragged lengths.
template <class CT>
struct HashCache {
  Scenario sc;
  kvc::KVExtents e;
  Index dim_v;
  std::vector<float> k_scales, v_scales;
  std::vector<CT> k, v;
  std::vector<Index> lengths;

  HashCache(CacheFormat format, kvc::KVExtents ext, Index dv, std::vector<Index> lens)
      : e(ext), dim_v(dv), lengths(std::move(lens)) {
    sc.format = format;
    sc.batch = e.batch;
    sc.kv_heads = e.heads;
    k_scales = sc.k_scales();
    v_scales = sc.v_scales();
    k = sc.stored<CT>(sc.fill(7, static_cast<std::size_t>(e.rows() * e.dim)), k_scales);
    v = sc.stored<CT>(sc.fill(8, static_cast<std::size_t>(e.rows() * dim_v)), v_scales);
  }
  auto access(std::vector<float> const& scales) const {
    if constexpr (kvc::is_fp8<CT>)
      return kvc::sequence_head_scales(scales.data(), e.heads);
    else
      return kvc::PlainAccess{};
  }
  auto view() {
    kvc::KVExtents ev = e;
    ev.dim = dim_v;
    return kvc::make_cache(kvc::bhtd_rows(k.data(), e, access(k_scales)),
                           kvc::bhtd_rows(v.data(), ev, access(v_scales)), kvc::head_lengths(lengths.data(), e.heads));
  }
};

/// Attention of 8 query heads x 3 rows per sequence (12 rows per KV head: whole groups of 4 and a remainder) with
/// d_k = 40 and d_v = 24 (partial lane blocks).
template <class CT>
std::vector<float> attention(CacheFormat format) {
  kvc::KVExtents const e{2, 2, 150, 40};
  HashCache<CT> c(format, e, 24, {150, 97, 64, 3});
  kvc::KVExtents const qe{2, 8, 3, 40};
  Scenario sc;
  std::vector<float> const q = sc.fill(9, static_cast<std::size_t>(qe.rows() * qe.dim));
  std::vector<Index> const qpos = {147, 148, 149, 140, 141, 142};
  kvc::AttendQueries<float> const queries{{q.data(), kvc::bhtd_layout(qe)}, qpos.data()};
  std::vector<float> out(static_cast<std::size_t>(qe.rows() * 24)), lse(static_cast<std::size_t>(qe.rows()));
  kvc::Cpu const cpu;
  auto const cache = c.view();
  kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(cpu, kvc::Attention{}, queries, cache));
  REQUIRE(kvc::attend(cpu, kvc::Attention{}, queries, cache, {out.data(), lse.data()}, ws.get()).ok());
  out.insert(out.end(), lse.begin(), lse.end());
  return out;
}
}  // namespace

TEST_CASE("fp8 caches: attention over GQA groups and partial lanes equals the dequantised cache's", "[engine][fp8]") {
  KVC_SKIP_WITHOUT_INSTRUCTIONS();
  CHECK(attention<kvc::float8_e4m3>(CacheFormat::e4m3) == attention<float>(CacheFormat::e4m3));
  CHECK(attention<kvc::float8_e5m2>(CacheFormat::e5m2) == attention<float>(CacheFormat::e5m2));
  CHECK(attention<float>(CacheFormat::e4m3) != attention<float>(CacheFormat::fp32));
}

TEST_CASE("fp8 caches: gather and append move bytes between fp8 views, and dequantise into fp32 ones",
          "[engine][fp8]") {
  KVC_SKIP_WITHOUT_INSTRUCTIONS();
  using F8 = kvc::float8_e4m3;
  kvc::KVExtents const e{2, 2, 20, 16};
  HashCache<F8> src(CacheFormat::e4m3, e, 16, {20, 11, 7, 20});
  HashCache<float> deq(CacheFormat::e4m3, e, 16, {20, 11, 7, 20});
  auto const plan = kvc::test::plan_of(2, 2, 20, {{0, 3, 19}, {1, 10}, {6}, {2, 4, 8, 16}});
  // fp8 into fp8 with the same scales: the bytes themselves.
  HashCache<F8> to8(CacheFormat::e4m3, e, 16, {0, 0, 0, 0});
  REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, src.view(), to8.view()).ok());
  // fp8 into fp32: the dequantised values, as gathering the dequantised cache gives.
  HashCache<float> to32(CacheFormat::fp32, e, 16, {0, 0, 0, 0});
  HashCache<float> want(CacheFormat::fp32, e, 16, {0, 0, 0, 0});
  REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, src.view(), to32.view()).ok());
  REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, deq.view(), want.view()).ok());
  for (Index bh = 0; bh < 4; ++bh)
    for (Index j = 0; j < plan.plan.kept(bh / 2, bh % 2); ++j) {
      Index const from = plan.plan.indices(bh / 2, bh % 2)[j];
      for (Index c = 0; c < 16; ++c) {
        auto const at = static_cast<std::size_t>((bh * 20 + j) * 16 + c);
        auto const was = static_cast<std::size_t>((bh * 20 + from) * 16 + c);
        REQUIRE(to8.k[at].bits == src.k[was].bits);
        REQUIRE(to8.v[at].bits == src.v[was].bits);
        REQUIRE(to32.k[at] == want.k[at]);
        REQUIRE(to32.v[at] == want.v[at]);
      }
    }
  CHECK(to8.lengths == std::vector<Index>{3, 2, 1, 4});
  // Append of fp8 rows under another scale: each value is re-stored under the destination's scale (the same value
  // where it is representable there; here the destination's scales are the source's halved, so every value is).
  HashCache<F8> other(CacheFormat::e4m3, e, 16, {0, 0, 0, 0});
  for (float& s : other.k_scales)
    s *= 0.5f;
  for (float& s : other.v_scales)
    s *= 0.5f;
  REQUIRE(kvc::append(kvc::Cpu{}, other.view(), src.view(), 0, 5).ok());
  for (Index bh = 0; bh < 4; ++bh)
    for (Index j = 0; j < other.lengths[static_cast<std::size_t>(bh)]; ++j)
      for (Index c = 0; c < 16; ++c) {
        auto const i = static_cast<std::size_t>((bh * 20 + j) * 16 + c);
        REQUIRE(kvc::load(other.k[i], other.k_scales[static_cast<std::size_t>(bh)]) ==
                kvc::load(src.k[i], src.k_scales[static_cast<std::size_t>(bh)]));
      }
  CHECK(other.lengths == std::vector<Index>{5, 5, 5, 5});
}
