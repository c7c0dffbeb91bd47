// SPDX-License-Identifier: Apache-2.0
// tests/engine/layer_compressor_test.cpp mirrors include/kvc/engine/layer_compressor.hpp: every policy through the
// one engine path (plan, bind, reset, prefill, attend, decode), checked against a hand-computed StreamingLLM trace,
// against the tools' own sequence of entry points (tools/common/observations.hpp, which kvc-eval's numbers came
// from), against kvc::blockwise_compress and kvc::moment_kv_prefill, and for what every session must keep true.
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/attention/corrected.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/state.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/moment_kv.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/scorers/uncomp.hpp>
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/selectors/uncomp.hpp>
#include <kvc/engine/layer_compressor.hpp>
#include <kvc/pipeline/blockwise.hpp>

#include "common/moment_kv.hpp"
#include "common/observations.hpp"
#include "support/catch.hpp"
#include "support/compressor_scenario.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

using kvc::Index;
using kvc::test::HostMemory;
using kvc::test::Scenario;
using kvc::test::ScenarioResult;

namespace {

ScenarioResult run(std::string const& name, Scenario const& sc = {}) {
  HostMemory mem;
  ScenarioResult r;
  std::string const err =
      kvc::test::with_scenario_policy<kvc::HostSpace>(name, sc, mem, [&](auto const& policy, auto const& options) {
        return kvc::test::run_scenario(kvc::Cpu{}, mem, policy, options, sc, r);
      });
  INFO(name << ": " << err);
  REQUIRE(err.empty());
  return r;
}

/// Kept positions of head (b, h) from a [B, Hkv, capacity] table and the lengths.
std::vector<Index> kept(std::vector<Index> const& positions, std::vector<Index> const& lengths, Scenario const& sc,
                        Index b, Index h) {
  Index const head = b * sc.kv_heads + h;
  auto const first = positions.begin() + head * sc.capacity;
  return {first, first + lengths[static_cast<std::size_t>(head)]};
}

/// The scenario's prompt in host memory: a dense cache over it, and the prompt's last queries with their positions.
struct HostPrompt {
  Scenario const& sc;
  std::vector<float> k = sc.prompt_keys(), v = sc.prompt_values(), q = sc.prompt_queries();
  std::vector<Index> lengths = sc.prompt_lengths(), positions = sc.slot_positions(), qpos = sc.prompt_query_positions();

  auto cache() {
    return kvc::dense_cache(k.data(), v.data(), sc.keys(), kvc::head_lengths(lengths.data(), sc.kv_heads),
                            positions.data());
  }
  kvc::TokenRows<float const, kvc::StridedLayout> rows() const {
    return {q.data(), kvc::bhtd_layout(sc.prompt_query_extents())};
  }
};

std::vector<Index> range(Index from, Index to) {
  std::vector<Index> out;
  for (Index i = from; i < to; ++i)
    out.push_back(i);
  return out;
}

}  // namespace

TEST_CASE("layer compressor: StreamingLLM's hand-computed session", "[engine][compressor]") {
  // Prefill keeps 12: the 4 sinks and the last 8 prompt tokens. Decoding (interval 8, target 16) compresses after
  // steps 8 and 16, each time from 20 or 24 tokens to the sinks and the newest 12; step 17's token then joins: the
  // sinks and the newest 13.
  Scenario const sc;
  ScenarioResult const r = run("streaming_llm", sc);
  CHECK(r.compressions == 2);
  for (Index b = 0; b < sc.batch; ++b) {
    Index const p = sc.prompt[static_cast<std::size_t>(b)];
    std::vector<Index> prefill = range(0, 4), end = range(0, 4);
    for (Index t : range(p - 8, p))
      prefill.push_back(t);
    for (Index t : range(p + 4, p + 17))
      end.push_back(t);
    for (Index h = 0; h < sc.kv_heads; ++h) {
      CHECK(kept(r.prefill_positions, r.prefill_lengths, sc, b, h) == prefill);
      CHECK(kept(r.positions, r.lengths, sc, b, h) == end);
    }
  }
}

TEST_CASE("layer compressor: every policy keeps a consistent cache", "[engine][compressor]") {
  Scenario const sc;
  for (std::string const& name : kvc::test::scenario_policies()) {
    INFO(name);
    ScenarioResult const r = run(name, sc);
    bool const one_by_one = name.find("moment_kv") != std::string::npos || name == "uncomp";
    bool const keeps_prompt = name.find("_decoding") != std::string::npos || name == "ada_kv_moment_kv_fits";
    CHECK(r.compressions == (one_by_one ? sc.steps : 2));
    for (Index b = 0; b < sc.batch; ++b) {
      Index const p = sc.prompt[static_cast<std::size_t>(b)];
      for (Index h = 0; h < sc.kv_heads; ++h) {
        std::vector<Index> const pre = kept(r.prefill_positions, r.prefill_lengths, sc, b, h);
        std::vector<Index> const end = kept(r.positions, r.lengths, sc, b, h);
        CHECK(!pre.empty());
        if (keeps_prompt)
          CHECK(static_cast<Index>(pre.size()) == p);  // only decoding compresses
        else
          CHECK(static_cast<Index>(pre.size()) < p);  // every other policy here evicts at prefill
        for (std::size_t i = 0; i < pre.size(); ++i)
          CHECK((pre[i] >= 0 && pre[i] < p && (i == 0 || pre[i - 1] < pre[i])));
        for (std::size_t i = 0; i < end.size(); ++i)
          CHECK((end[i] >= 0 && end[i] < p + sc.steps && (i == 0 || end[i - 1] < end[i])));
        // The newest token always survives: it arrived after the last compression or was protected by it.
        CHECK((!end.empty() && end.back() == p + sc.steps - 1));
        // Every kept slot holds the row generated for its position (compaction moved rows with positions).
        for (std::size_t j = 0; j < end.size(); ++j) {
          Index const pos = end[j], head = b * sc.kv_heads + h;
          for (Index c = 0; c < sc.dim; ++c) {
            float const expect =
                pos < p ? Scenario::value(1, static_cast<std::uint64_t>(((head * sc.capacity) + pos) * sc.dim + c))
                        : Scenario::value(100 + 2 * static_cast<std::uint64_t>(pos - p),
                                          static_cast<std::uint64_t>(head * sc.dim + c));
            REQUIRE(r.keys[static_cast<std::size_t>((head * sc.capacity + static_cast<Index>(j)) * sc.dim + c)] ==
                    expect);
          }
        }
      }
    }
    for (float x : r.attention)
      REQUIRE(std::isfinite(x));
  }
}

TEST_CASE("layer compressor: prefill equals the tools' sequence of entry points", "[engine][compressor]") {
  // tools::with_observations + kvc::compress + kvc::compact is how kvc and kvc-eval compressed after a prompt.
  Scenario const sc;
  for (std::string const& name : kvc::test::scenario_policies()) {
    if (name.find("moment_kv") != std::string::npos || name == "uncomp" || name.find("_decoding") != std::string::npos)
      continue;  // their own drivers (the next test cases), or no compression at prefill
    INFO(name);
    ScenarioResult const r = run(name, sc);
    HostMemory mem;
    kvc::KVExtents const e = sc.keys();
    HostPrompt prompt{sc};
    auto const cache = prompt.cache();
    kvc::test::OwnedRope const rope(kvc::RopeSpec{}, e.dim, sc.rope_positions);
    std::vector<Index> index(static_cast<std::size_t>(e.rows())), count(static_cast<std::size_t>(e.batch * e.heads));
    kvc::KeepPlan<> const plan{index.data(), count.data(), e.batch, e.heads, e.tokens};
    std::string const err = kvc::test::with_scenario_policy<kvc::HostSpace>(
        name, sc, mem, [&](auto const& policy, auto const&) -> std::string {
          using S = std::remove_cvref_t<decltype(policy.scorer)>;
          if constexpr (kvc::detail::is_moment_kv<S> || kvc::detail::is_uncomp<S>) {
            return "not a tools-path policy";
          } else {
            auto selector = policy.selector;
            if constexpr (requires { selector.budget.layer; })
              selector.budget.layer = 1;  // run_scenario binds layer 1
            kvc::tools::ObservationStorage store;
            kvc::Status st;
            kvc::tools::with_observations(
                policy.scorer, cache,
                kvc::tools::ObservedQueries{prompt.rows(), prompt.qpos.data(), rope.table, kvc::RopeSpec{}, true}, name,
                store, [&](auto const& live, auto const& obs) {
                  kvc::Press const press{live, selector};
                  kvc::test::OwnedWorkspace ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e, obs));
                  st = kvc::compress(kvc::Cpu{}, press, cache, obs, plan, ws.get());
                  if (st.ok())
                    st = kvc::compact(kvc::Cpu{}, plan, cache);
                });
            return st.ok() ? std::string() : std::string(st.message());
          }
        });
    REQUIRE(err.empty());
    CHECK(prompt.lengths == r.prefill_lengths);
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h)
        CHECK(kept(prompt.positions, prompt.lengths, sc, b, h) ==
              kept(r.prefill_positions, r.prefill_lengths, sc, b, h));
  }
}

TEST_CASE("layer compressor: MomentKV's prefill is kvc::moment_kv_prefill, and its moments hold every eviction",
          "[engine][compressor][moment_kv]") {
  Scenario const sc;
  kvc::KVExtents const e = sc.keys();
  for (std::string const name : {"moment_kv", "ada_kv_moment_kv", "moment_kv_base"}) {
    INFO(name);
    HostMemory mem;
    std::string const err = kvc::test::with_scenario_policy<kvc::HostSpace>(
        name, sc, mem, [&](auto const& policy, auto options) -> std::string {
          if constexpr (!kvc::detail::is_moment_kv<std::remove_cvref_t<decltype(policy.scorer)>>) {
            return "not MomentKV";
          } else {
            // The compressor, by hand, on one cache; kvc::moment_kv_prefill on a copy.
            HostPrompt one{sc}, two{sc};
            auto const cache = one.cache();
            auto const cache2 = two.cache();
            kvc::test::OwnedRope const rope(kvc::RopeSpec{}, e.dim, sc.rope_positions);
            options.rope = rope.table;
            kvc::TokenRows<float const, kvc::StridedLayout> const rows = one.rows();
            std::vector<Index> const& qpos = one.qpos;
            std::vector<Index> const &lengths = one.lengths, &lengths2 = two.lengths;

            kvc::LayerCompressor c(kvc::Cpu{}, policy, options);
            REQUIRE(c.plan(cache, kvc::QueryShape{sc.q_heads, sc.window, 1, 1}).ok());
            std::vector<std::byte> state(c.state_bytes());
            kvc::test::OwnedWorkspace ws(c.workspace_bytes());
            REQUIRE(c.bind(state.data(), state.size()).ok());
            REQUIRE(c.reset().ok());
            REQUIRE(c.prefill(cache, kvc::LayerQueries<float>{rows, qpos.data()}, ws.get()).ok());

            kvc::tools::HostMoments<float> moments(e.batch, e.heads, e.dim, e.dim);
            auto scorer = policy.scorer;
            scorer.state = moments.view;
            auto const obs = kvc::observe(kvc::WindowQueries<float>{rows, rope.table, qpos.data()});
            if (scorer.mi) {
              kvc::test::OwnedWorkspace ws2(
                  kvc::moment_kv_prefill_workspace_bytes(kvc::Cpu{}, scorer, policy.selector, e, obs));
              REQUIRE(kvc::moment_kv_prefill(kvc::Cpu{}, scorer, policy.selector, cache2, obs, ws2.get()).ok());
            } else {  // mi = false: the base scorer (SnapKV) selects in one shot, then the evicted tokens fold
              std::vector<Index> index(static_cast<std::size_t>(e.rows())),
                  count(static_cast<std::size_t>(e.batch * e.heads));
              kvc::KeepPlan<> const plan{index.data(), count.data(), e.batch, e.heads, e.tokens};
              kvc::Press const base{scorer.base, policy.selector};
              kvc::test::OwnedWorkspace ws2(std::max(kvc::compress_workspace_bytes(kvc::Cpu{}, base, e, obs),
                                                     kvc::on_evict_workspace_bytes(kvc::Cpu{}, scorer, e)));
              REQUIRE(kvc::compress(kvc::Cpu{}, base, cache2, obs, plan, ws2.get()).ok());
              REQUIRE(kvc::on_evict(kvc::Cpu{}, scorer, cache2, plan, ws2.get()).ok());
              REQUIRE(kvc::compact(kvc::Cpu{}, plan, cache2).ok());
            }
            CHECK(lengths == lengths2);
            CHECK(one.positions == two.positions);
            auto const m = c.moments();
            for (Index head = 0; head < e.batch * e.heads; ++head) {
              CHECK(m.count[head] ==
                    sc.prompt[static_cast<std::size_t>(head / e.heads)] - lengths[static_cast<std::size_t>(head)]);
              for (Index i = 0; i < e.dim; ++i) {
                CHECK(m.key_mean[head * e.dim + i] == moments.view.key_mean[head * e.dim + i]);
                CHECK(m.value_mean[head * e.dim + i] == moments.view.value_mean[head * e.dim + i]);
                for (Index j = 0; j < e.dim; ++j)
                  CHECK(m.comoment[(head * e.dim + i) * e.dim + j] ==
                        moments.view.comoment[(head * e.dim + i) * e.dim + j]);
              }
            }
            return {};
          }
        });
    REQUIRE(err.empty());
  }
  // Decoding (Algorithm 1, one eviction per step): each head returns to its budget after every token, 16 for the
  // uniform selector and its prefill length for AdaKV's; when the prompts fit AdaKV's budget (nothing evicted at
  // prefill), every head grows to the target (48: the first sequence's 40 + 17 tokens are cut to it, the second's
  // 29 + 17 never reach it). Its moments count every token it evicted.
  for (std::string const name : {"moment_kv", "ada_kv_moment_kv", "moment_kv_base", "ada_kv_moment_kv_fits"}) {
    INFO(name);
    ScenarioResult const r = run(name, sc);
    for (Index b = 0; b < sc.batch; ++b)
      for (Index h = 0; h < sc.kv_heads; ++h) {
        auto const head = static_cast<std::size_t>(b * sc.kv_heads + h);
        Index const seen = sc.prompt[static_cast<std::size_t>(b)] + sc.steps;
        Index const budget = name == "ada_kv_moment_kv"        ? r.prefill_lengths[head]
                             : name == "ada_kv_moment_kv_fits" ? std::min<Index>(48, seen)
                                                               : 16;
        CHECK(r.lengths[head] == budget);
        CHECK(r.moment_counts[head] == sc.prompt[static_cast<std::size_t>(b)] + sc.steps - r.lengths[head]);
      }
  }
}

TEST_CASE("layer compressor: prefill after every chunk is KeyDiff's block-wise protocol", "[engine][compressor]") {
  // C_i = pi_N(C_{i-1} || block_i) with N = 6, blocks of 5 over 23 tokens: the compressor after each appended chunk
  // keeps what kvc::blockwise_compress keeps.
  Index const n = 23, d = 8, budget = 6, block = 5;
  kvc::KVExtents const src_e{1, 2, n, d};
  std::vector<float> k(static_cast<std::size_t>(src_e.rows() * d)), v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = Scenario::value(11, i);
    v[i] = Scenario::value(12, i);
  }
  auto const src = kvc::dense_cache(k.data(), v.data(), src_e);
  kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::FixedBudget{budget}}};
  Index const cap = kvc::blockwise_capacity(press.selector, block);
  kvc::KVExtents const work_e{1, 2, cap, d};

  std::vector<float> wk(static_cast<std::size_t>(work_e.rows() * d)), wv(wk.size());
  std::vector<Index> wl(2, 0), wp(static_cast<std::size_t>(work_e.rows()), 0);
  auto const work = kvc::dense_cache(wk.data(), wv.data(), work_e, kvc::head_lengths(wl.data(), 2), wp.data());
  kvc::test::OwnedWorkspace bws(kvc::blockwise_workspace_bytes(kvc::Cpu{}, press, work_e));
  REQUIRE(kvc::blockwise_compress(kvc::Cpu{}, press, src, block, work, bws.get()).ok());

  std::vector<float> ck(wk.size()), cv(wk.size());
  std::vector<Index> cl(2, 0), cp(wp.size(), 0);
  auto const cache = kvc::dense_cache(ck.data(), cv.data(), work_e, kvc::head_lengths(cl.data(), 2), cp.data());
  kvc::LayerCompressor c(kvc::Cpu{}, press);
  REQUIRE(c.plan(cache, kvc::QueryShape{2, 0, 1, 1}).ok());
  std::vector<std::byte> state(c.state_bytes() + 1);
  kvc::test::OwnedWorkspace ws(c.workspace_bytes());
  REQUIRE(c.bind(state.data(), state.size()).ok());
  REQUIRE(c.reset().ok());
  for (Index start = 0; start < n; start += block) {
    REQUIRE(kvc::append(kvc::Cpu{}, cache, src, start, block).ok());
    REQUIRE(c.prefill(cache, {}, ws.get()).ok());
  }
  CHECK(cl == wl);
  CHECK(cp == wp);
  CHECK(ck == wk);
}

TEST_CASE("layer compressor: clear errors before anything changes", "[engine][compressor]") {
  Scenario const sc;
  kvc::KVExtents const e = sc.keys();
  std::vector<float> k(static_cast<std::size_t>(e.rows() * e.dim), 0.5f), v = k;
  std::vector<Index> lengths(static_cast<std::size_t>(e.batch * e.heads), 30),
      positions(static_cast<std::size_t>(e.rows()));
  for (Index i = 0; i < e.rows(); ++i)
    positions[static_cast<std::size_t>(i)] = i % e.tokens;
  auto const cache =
      kvc::dense_cache(k.data(), v.data(), e, kvc::head_lengths(lengths.data(), e.heads), positions.data());
  auto message = [](kvc::Status const& st) { return std::string(st.message()); };

  kvc::LayerCompressor snap(kvc::Cpu{}, kvc::Press{kvc::SnapKVScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}}});
  kvc::test::OwnedWorkspace none(0);
  CHECK_THAT(message(snap.prefill(cache, {}, none.get())), Catch::Contains("call plan(), bind() and reset() first"));
  CHECK_THAT(message(snap.plan(cache, kvc::QueryShape{3, 8, 1, 1})), Catch::Contains("multiple of the KV heads"));
  REQUIRE(snap.plan(cache, kvc::QueryShape{4, 8, 1, 1}).ok());
  std::vector<std::byte> state(snap.state_bytes());
  CHECK(snap.bind(state.data(), state.size()).ok());
  CHECK(snap.reset().ok());
  kvc::test::OwnedWorkspace small(snap.workspace_bytes() - 1);
  CHECK_THAT(message(snap.prefill(cache, {}, small.get())), Catch::Contains("workspace smaller than"));
  kvc::test::OwnedWorkspace ws(snap.workspace_bytes());
  std::vector<float> q(static_cast<std::size_t>(e.batch * 4 * 8 * e.dim), 0.1f);
  kvc::TokenRows<float const, kvc::StridedLayout> const rows(q.data(), kvc::bhtd_layout({e.batch, 4, 8, e.dim}));
  CHECK_THAT(message(snap.prefill(cache, kvc::LayerQueries<float>{rows, nullptr}, ws.get())),
             Catch::Contains("positions ([batch, n]) are required"));
  kvc::TokenRows<float const, kvc::StridedLayout> const wide(q.data(), kvc::bhtd_layout({e.batch, 2, 16, e.dim}));
  std::vector<Index> qpos(32, 29);
  CHECK_THAT(message(snap.prefill(cache, kvc::LayerQueries<float>{wide, qpos.data()}, ws.get())),
             Catch::Contains("[batch, Hq, <= prompt_rows, d_k]"));
  CHECK(lengths == std::vector<Index>(lengths.size(), 30));  // nothing moved

  kvc::KVExtents bigger = e;
  bigger.tokens += 1;
  std::vector<float> kb(static_cast<std::size_t>(bigger.rows() * e.dim));
  auto const other = kvc::dense_cache(kb.data(), kb.data(), bigger, kvc::head_lengths(lengths.data(), e.heads));
  CHECK_THAT(message(snap.prefill(other, {}, ws.get())), Catch::Contains("planned batch, KV heads and dims"));

  kvc::LayerCompressor ea(kvc::Cpu{},
                          kvc::Press{kvc::ExpectedAttentionScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}}});
  CHECK_THAT(message(ea.plan(cache, kvc::QueryShape{4, 8, 1, 1})), Catch::Contains("set options.rope"));

  kvc::CompressorOptions<kvc::HostSpace> bad;
  bad.decode = true;
  bad.schedule.compression_interval = 0;
  kvc::LayerCompressor knorm(kvc::Cpu{}, kvc::Press{kvc::KnormScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}}}, bad);
  CHECK_THAT(message(knorm.plan(cache, kvc::QueryShape{4, 0, 1, 1})), Catch::Contains("compression_interval"));
  kvc::LayerCompressor ratio(kvc::Cpu{}, kvc::Press{kvc::KnormScorer{}, kvc::TopKSelector{kvc::RatioBudget{1.5}}});
  CHECK(!ratio.plan(cache, kvc::QueryShape{4, 0, 1, 1}).ok());
  CHECK_THAT(message(snap.bind(state.data(), snap.state_bytes() - 1)),
             Catch::Contains("state smaller than state_bytes()"));
  CHECK_THAT(message(snap.plan(cache, kvc::QueryShape{4, 0, 1, 1})), Catch::Contains("prompt_rows"));

  // bind() without reset(), and a copy of a bound compressor (it shares no state: it must bind its own).
  kvc::LayerCompressor h2o(kvc::Cpu{}, kvc::Press{kvc::H2OScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}}});
  REQUIRE(h2o.plan(cache, kvc::QueryShape{4, 8, 1, 1}).ok());
  std::vector<std::byte> h2o_state(h2o.state_bytes());
  kvc::test::OwnedWorkspace h2o_ws(h2o.workspace_bytes());
  REQUIRE(h2o.bind(h2o_state.data(), h2o_state.size()).ok());
  CHECK_THAT(message(h2o.prefill(cache, kvc::LayerQueries<float>{rows, qpos.data()}, h2o_ws.get())),
             Catch::Contains("reset() first"));
  REQUIRE(h2o.reset().ok());
  auto copy = h2o;
  CHECK_THAT(message(copy.prefill(cache, kvc::LayerQueries<float>{rows, qpos.data()}, h2o_ws.get())),
             Catch::Contains("bind() and reset() first"));
  CHECK(lengths == std::vector<Index>(lengths.size(), 30));

  kvc::CompressorOptions<kvc::HostSpace> decoding_only;
  decoding_only.prefill = false;
  kvc::LayerCompressor moment(kvc::Cpu{}, kvc::Press{kvc::MomentKVScorer{}, kvc::TopKSelector{kvc::FixedBudget{8}}},
                              decoding_only);
  CHECK_THAT(message(moment.plan(cache, kvc::QueryShape{4, 8, 1, 1})), Catch::Contains("options.prefill must be true"));
}

TEST_CASE("push_queries: rows and positions land after the buffer's count", "[engine][state]") {
  std::vector<float> data(2 * 3 * 4 * 2, -1.0f);
  std::vector<Index> pos(2 * 4, -1);
  kvc::QueryBuffer<float> buf{data.data(), pos.data(), 2, 3, 4, 2};
  buf.count = 1;
  std::vector<float> rows(2 * 3 * 2 * 2);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<float>(i);
  std::vector<Index> const rp = {10, 11, 20, 21};
  kvc::TokenRows<float const, kvc::StridedLayout> const view(rows.data(), kvc::bhtd_layout({2, 3, 2, 2}));
  REQUIRE(kvc::push_queries(kvc::Cpu{}, buf, view, rp.data()).ok());
  CHECK(buf.count == 3);
  CHECK(buf.fresh == 2);
  // (b, q, i) of the rows -> slot 1 + i of (b, q): rows are [b][q][i][c] = ((b * 3 + q) * 2 + i) * 2 + c.
  for (Index b = 0; b < 2; ++b)
    for (Index q = 0; q < 3; ++q)
      for (Index i = 0; i < 2; ++i)
        for (Index c = 0; c < 2; ++c)
          CHECK(buf.row(b, q, 1 + i)[c] == static_cast<float>(((b * 3 + q) * 2 + i) * 2 + c));
  CHECK(pos == std::vector<Index>{-1, 10, 11, -1, -1, 20, 21, -1});
  CHECK(buf.row(0, 0, 0)[0] == -1.0f);
  CHECK(kvc::push_queries(kvc::Cpu{}, buf, view, rp.data()).code() == kvc::Errc::out_of_capacity);

  // With a fill (the count in the backend's memory), each push leaves it at the new count; one overlapping the
  // buffer's positions is refused before anything is written.
  Index fill = 1;
  buf.count = 1;
  buf.fill = &fill;
  kvc::TokenRows<float const, kvc::StridedLayout> const one(rows.data(), kvc::bhtd_layout({2, 3, 1, 2}));
  REQUIRE(kvc::push_queries(kvc::Cpu{}, buf, one, rp.data()).ok());
  CHECK((fill == 2 && buf.count == 2));
  buf.fill = pos.data() + 3;
  CHECK(kvc::push_queries(kvc::Cpu{}, buf, one, rp.data()).code() == kvc::Errc::invalid_argument);
  CHECK((pos[3] == -1 && buf.count == 2));
}

TEST_CASE("layer compressor: compresses_next() and replayed() count steps as decode() does", "[engine][compressor]") {
  // An engine with CUDA graphs calls decode() for the first plain and the first compressing step (capturing them)
  // and replayed() for the rest; the host's schedule and the query buffer's count must then advance as in a session
  // of decode() calls (SnapKV: a window of the last 3 buffered rows, a compression every 3 steps).
  Scenario const sc;
  HostPrompt p1{sc}, p2{sc};
  kvc::CompressorOptions<kvc::HostSpace> options;
  options.decode = true;
  options.schedule = {3, 16, 3};
  kvc::Press const policy{kvc::SnapKVScorer{.window_size = 3}, kvc::TopKSelector{kvc::RatioBudget{0.5}, 0, 3}};
  kvc::LayerCompressor called(kvc::Cpu{}, policy, options), replaying(kvc::Cpu{}, policy, options);
  bool flag = true;
  CHECK(replaying.replayed(&flag).code() == kvc::Errc::invalid_argument);  // not planned
  CHECK_FALSE(flag);
  kvc::QueryShape const shape{sc.q_heads, sc.window, 1, 1};
  REQUIRE((called.plan(p1.cache(), shape).ok() && replaying.plan(p2.cache(), shape).ok()));
  HostMemory memory;
  kvc::test::OwnedWorkspace ws(called.workspace_bytes());
  REQUIRE(called.bind(memory.alloc<std::byte>(called.state_bytes()), called.state_bytes()).ok());
  REQUIRE(replaying.bind(memory.alloc<std::byte>(called.state_bytes()), called.state_bytes()).ok());
  REQUIRE((called.reset().ok() && replaying.reset().ok()));
  REQUIRE(called.prefill(p1.cache(), {p1.rows(), p1.qpos.data()}, ws.get()).ok());
  REQUIRE(replaying.prefill(p2.cache(), {p2.rows(), p2.qpos.data()}, ws.get()).ok());
  kvc::KVExtents const q1{sc.batch, sc.q_heads, 1, sc.dim};
  std::vector<float> const q = sc.fill(9, static_cast<std::size_t>(q1.rows() * sc.dim));
  std::vector<Index> const qpos(static_cast<std::size_t>(sc.batch), 40);
  kvc::LayerQueries<float> const step{{q.data(), kvc::bhtd_layout(q1)}, qpos.data()};
  std::vector<int> next, done, next_replaying, done_replaying;
  bool seen[2] = {false, false};
  for (int s = 0; s < 8; ++s) {
    next.push_back(called.compresses_next());
    bool compressed = false;
    REQUIRE(called.decode(p1.cache(), step, ws.get(), &compressed).ok());
    done.push_back(compressed);
    bool const kind = replaying.compresses_next();
    next_replaying.push_back(kind);
    if (!seen[kind])
      REQUIRE(replaying.decode(p2.cache(), step, ws.get(), &compressed).ok());
    else
      REQUIRE(replaying.replayed(&compressed).ok());
    seen[kind] = true;
    done_replaying.push_back(compressed);
    CHECK(replaying.counter().steps == called.counter().steps);
    CHECK(replaying.query_buffer().count == called.query_buffer().count);
    CHECK(*called.query_buffer().fill == called.query_buffer().count);  // the CPU's push keeps the fill too
  }
  CHECK(next == std::vector<int>{0, 0, 1, 0, 0, 1, 0, 0});
  CHECK(done == next);
  CHECK(next_replaying == next);
  CHECK(done_replaying == next);
  CHECK(replaying.counter().compressions == 2);
  CHECK(called.counter().compressions == 2);

  // A new sequence on the same graphs: replays alone count the buffer's rows (the captured steps' one row each).
  REQUIRE(replaying.reset().ok());
  REQUIRE(replaying.prefill(p2.cache(), {p2.rows(), p2.qpos.data()}, ws.get()).ok());
  for (Index s = 1; s <= 2; ++s) {
    REQUIRE(replaying.replayed().ok());
    CHECK(replaying.query_buffer().count == s);
  }
  REQUIRE(replaying.replayed(&flag).ok());
  CHECK((flag && replaying.query_buffer().count == 0 && replaying.counter().compressions == 1));

  // H2O folds each step's rows into its state and keeps no buffer; a step without query rows still counts.
  kvc::LayerCompressor h2o(kvc::Cpu{}, kvc::Press{kvc::H2OScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}, 0, 4}},
                           options);
  REQUIRE(h2o.plan(p1.cache(), shape).ok());
  CHECK(h2o.query_buffer().capacity == 0);
  REQUIRE((h2o.bind(memory.alloc<std::byte>(h2o.state_bytes()), h2o.state_bytes()).ok() && h2o.reset().ok()));
  kvc::test::OwnedWorkspace h2o_ws(h2o.workspace_bytes());
  REQUIRE(h2o.prefill(p1.cache(), {p1.rows(), p1.qpos.data()}, h2o_ws.get()).ok());
  kvc::LayerQueries<float> const none{{q.data(), kvc::bhtd_layout({sc.batch, sc.q_heads, 0, sc.dim})}, qpos.data()};
  REQUIRE(h2o.decode(p1.cache(), none, h2o_ws.get()).ok());
  REQUIRE(h2o.decode(p1.cache(), step, h2o_ws.get()).ok());
  CHECK(h2o.counter().steps == 2);

  // Without decode-time compression nothing is due and replayed() counts nothing; MomentKV replays only after its
  // prefill, as it decodes.
  kvc::LayerCompressor still(kvc::Cpu{}, policy);
  REQUIRE(still.plan(p1.cache(), shape).ok());
  REQUIRE((still.bind(memory.alloc<std::byte>(still.state_bytes()), still.state_bytes()).ok() && still.reset().ok()));
  CHECK_FALSE(still.compresses_next());
  REQUIRE(still.replayed().ok());
  CHECK(still.counter().steps == 0);
  options.schedule = {1, 16, 1};
  kvc::LayerCompressor moment(kvc::Cpu{}, kvc::Press{kvc::MomentKVScorer{}, kvc::TopKSelector{kvc::FixedBudget{16}}},
                              options);
  REQUIRE(moment.plan(p1.cache(), shape).ok());
  REQUIRE(
      (moment.bind(memory.alloc<std::byte>(moment.state_bytes()), moment.state_bytes()).ok() && moment.reset().ok()));
  CHECK_THAT(std::string(moment.replayed().message()), Catch::Contains("call prefill() first"));
}

TEST_CASE("decode_budgets: each head keeps its length unless nothing was evicted", "[engine][state]") {
  // Sequence 0 evicted (6 < 10): every head keeps its length, even below the target. Sequence 1 evicted nothing:
  // heads grow to the target 8, a head already past it keeps its length.
  std::vector<Index> budgets = {10, 10, 10, 9, 5, 5};  // lengths before the prefill compression
  std::vector<Index> const lengths = {6, 8, 10, 9, 5, 5};
  REQUIRE(kvc::decode_budgets(kvc::Cpu{}, budgets.data(), lengths.data(), 2, 3, 8).ok());
  CHECK(budgets == std::vector<Index>{6, 8, 10, 9, 8, 8});
  CHECK(kvc::decode_budgets(kvc::Cpu{}, budgets.data(), budgets.data() + 1, 1, 3, 8).code() ==
        kvc::Errc::invalid_argument);  // overlapping
  CHECK(kvc::decode_budgets(kvc::Cpu{}, budgets.data(), lengths.data(), 2, 3, -1).code() ==
        kvc::Errc::invalid_argument);
  CHECK(kvc::decode_budgets(kvc::Cpu{}, budgets.data(), nullptr, 2, 3, 8).code() == kvc::Errc::invalid_argument);
}

namespace {

/// The decode selection the tools built by hand: the schedule's FixedBudget target with the policy's windows
/// (kvc-eval's DecodeRun), AdaKV over that target, UNComp's budget table as it is.
template <kvc::Budget Bu>
kvc::TopKSelector<kvc::FixedBudget> by_hand_decode_selector(kvc::TopKSelector<Bu> const& s,
                                                            kvc::DecodeSchedule schedule) {
  schedule.n_sink = s.n_sink;
  schedule.n_recent = s.n_recent;
  return schedule.selector();
}
template <kvc::Budget Bu>
kvc::AdaKVSelector<kvc::FixedBudget> by_hand_decode_selector(kvc::AdaKVSelector<Bu> const& s,
                                                             kvc::DecodeSchedule const& schedule) {
  return {{schedule.target_size}, s.alpha_safeguard, s.reference, s.n_sink, s.n_recent};
}
inline kvc::UNCompSelector<> by_hand_decode_selector(kvc::UNCompSelector<> const& s, kvc::DecodeSchedule const&) {
  return s;
}

/// The session of run_scenario written out with the building blocks, the way docs/integration.md told engines before
/// the compressor (kvc::update, kvc::compress, kvc::on_evict, kvc::compact with the state, a QueryBuffer filled by
/// hand and kvc::decode_step), for the stateful scorers (H2O, UNComp) and a window scorer (SnapKV).
template <class S, class Sel>
ScenarioResult run_by_hand(S scorer, Sel const& selector, kvc::CompressorOptions<kvc::HostSpace> const& options,
                           Scenario const& sc) {
  kvc::KVExtents const e = sc.keys();
  HostPrompt prompt{sc};
  auto const cache = prompt.cache();
  kvc::test::OwnedRope const rope(kvc::RopeSpec{}, e.dim, sc.rope_positions);
  // The scorer's state.
  std::vector<float> state(static_cast<std::size_t>(e.rows() * sc.window), 0.0f);
  std::vector<Index> tracked(static_cast<std::size_t>(e.batch * e.heads), 0);
  if constexpr (kvc::detail::is_h2o<S>)
    scorer.state = {{state.data(), e.batch, e.heads, e.tokens}, tracked.data()};
  if constexpr (kvc::detail::is_uncomp<S>)
    scorer.state = {{state.data(), kvc::uncomp_window_layout(e, scorer.window_size)}, tracked.data()};
  kvc::test::OwnedWorkspace ws(1 << 22);
  kvc::test::OwnedPlan plan(e.batch, e.heads, e.tokens);

  auto const window = kvc::observe(kvc::WindowQueries<float>{prompt.rows(), rope.table, prompt.qpos.data()});
  kvc::Press const press{scorer, selector};
  if (!options.prefill) {  // DecodingPress: the prompt only starts the state
    if constexpr (kvc::StatefulScorer<S>)
      REQUIRE(kvc::update(kvc::Cpu{}, scorer, cache, window, ws.get()).ok());
  } else if constexpr (kvc::StatefulScorer<S>) {
    REQUIRE(kvc::update(kvc::Cpu{}, scorer, cache, window, ws.get()).ok());
    REQUIRE(kvc::compress(kvc::Cpu{}, press, cache, kvc::NoObservations{}, plan.plan, ws.get()).ok());
    REQUIRE(kvc::on_evict(kvc::Cpu{}, scorer, cache, plan.plan, ws.get()).ok());
    REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache, kvc::carried_state(scorer)).ok());
  } else {
    REQUIRE(kvc::compress(kvc::Cpu{}, press, cache, window, plan.plan, ws.get()).ok());
    REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, cache).ok());
  }
  ScenarioResult r;
  r.prefill_lengths = prompt.lengths;
  r.prefill_positions = prompt.positions;

  Index const rows = options.schedule.compression_interval;
  std::vector<float> buffered(static_cast<std::size_t>(e.batch * sc.q_heads * rows * e.dim));
  std::vector<Index> buffered_pos(static_cast<std::size_t>(e.batch * rows));
  kvc::QueryBuffer<float> buf{buffered.data(), buffered_pos.data(), e.batch, sc.q_heads, rows, e.dim};
  kvc::DecodeCounter counter;
  kvc::KVExtents const one{e.batch, e.heads, 1, e.dim};
  auto const decode_selector = by_hand_decode_selector(selector, options.schedule);
  for (Index s = 0; s < sc.steps; ++s) {
    std::vector<float> k1 =
        sc.fill(100 + 2 * static_cast<std::uint64_t>(s), static_cast<std::size_t>(one.rows() * e.dim));
    std::vector<float> v1 = sc.fill(101 + 2 * static_cast<std::uint64_t>(s), k1.size());
    std::vector<Index> token_pos;
    for (Index b = 0; b < e.batch; ++b)
      token_pos.insert(token_pos.end(), static_cast<std::size_t>(e.heads), sc.prompt[static_cast<std::size_t>(b)] + s);
    REQUIRE(
        kvc::append(kvc::Cpu{}, cache, kvc::dense_cache(k1.data(), v1.data(), one, kvc::Lengths{}, token_pos.data()))
            .ok());
    std::vector<float> const step_q =
        sc.fill(200 + static_cast<std::uint64_t>(s), static_cast<std::size_t>(e.batch * sc.q_heads * e.dim));
    for (Index b = 0; b < e.batch; ++b) {
      for (Index h = 0; h < sc.q_heads; ++h)
        std::copy_n(step_q.data() + (b * sc.q_heads + h) * e.dim, e.dim, buf.row(b, h, buf.count));
      buffered_pos[static_cast<std::size_t>(b * rows + buf.count)] = sc.prompt[static_cast<std::size_t>(b)] + s;
    }
    REQUIRE(buf.push(1).ok());
    REQUIRE(kvc::decode_step(kvc::Cpu{}, scorer, decode_selector, options.schedule, cache, buf, counter, rope.table,
                             ws.get())
                .ok());
  }
  r.lengths = prompt.lengths;
  r.positions = prompt.positions;
  r.compressions = counter.compressions;
  return r;
}

}  // namespace

TEST_CASE("layer compressor: a session equals the one written with the building blocks", "[engine][compressor]") {
  Scenario const sc;
  for (std::string const name : {"h2o", "uncomp", "snap_kv", "ada_kv_h2o", "h2o_decoding", "snap_kv_decoding"}) {
    INFO(name);
    ScenarioResult const r = run(name, sc);
    HostMemory mem;
    ScenarioResult by_hand;
    std::string const err = kvc::test::with_scenario_policy<kvc::HostSpace>(
        name, sc, mem, [&](auto const& policy, auto const& options) -> std::string {
          using S = std::remove_cvref_t<decltype(policy.scorer)>;
          if constexpr (kvc::detail::is_moment_kv<S> || has_need(S::needs, kvc::Needs::query_statistics)) {
            return "not a building-block session";
          } else {
            by_hand = run_by_hand(policy.scorer, policy.selector, options, sc);
            return {};
          }
        });
    REQUIRE(err.empty());
    CHECK(by_hand.compressions == r.compressions);
    CHECK(by_hand.prefill_lengths == r.prefill_lengths);
    CHECK(by_hand.lengths == r.lengths);
    for (Index b = 0; b < sc.batch; ++b)
      for (Index h = 0; h < sc.kv_heads; ++h) {
        CHECK(kept(by_hand.prefill_positions, by_hand.prefill_lengths, sc, b, h) ==
              kept(r.prefill_positions, r.prefill_lengths, sc, b, h));
        CHECK(kept(by_hand.positions, by_hand.lengths, sc, b, h) == kept(r.positions, r.lengths, sc, b, h));
      }
  }
}

TEST_CASE("layer compressor: the decode selection, and reset() between sequences", "[engine][compressor]") {
  kvc::DecodeSchedule schedule;
  schedule.target_size = 40;
  auto const topk = kvc::detail::decode_selection(kvc::TopKSelector{kvc::RatioBudget{0.5}, 2, 3}, schedule);
  CHECK(topk.budget.tokens == 40);
  CHECK((topk.n_sink == 2 && topk.n_recent == 3));
  schedule.n_recent = 12;  // the schedule's windows, where set, replace the selector's
  auto const ada = kvc::detail::decode_selection(
      kvc::AdaKVSelector<kvc::RatioBudget>{{0.5}, 0.3, kvc::Reference::kvpress, 1, 4}, schedule);
  CHECK(ada.budget.tokens == 40);
  CHECK((ada.alpha_safeguard == 0.3 && ada.reference == kvc::Reference::kvpress && ada.n_sink == 1 &&
         ada.n_recent == 12));
  Index const table[2] = {5, 7};
  auto const uncomp = kvc::detail::decode_selection(kvc::UNCompSelector<>{kvc::HeadBudgets{table, 2}, 0, 8}, schedule);
  CHECK((uncomp.budget.tokens == table && uncomp.n_recent == 12));
  // PyramidKV keeps its layer schedule around the target (the authors' with C = 40, w = 8, beta = 20, 4 layers, 200
  // tokens: B = 32, min = 32 // 20 = 1, max = 2B - min = 63, steps = (63 - 1) // 3 = 20; layer l keeps 63 - 20 l + 8).
  kvc::PyramidKVBudget py;
  py.num_layers = 4;
  py.reference = kvc::Reference::kvpress;
  py.compression_ratio = 0.5;
  auto const pyramid = kvc::detail::decode_selection(kvc::TopKSelector{py, 0, 8}, schedule);
  CHECK((pyramid.budget.reference == kvc::Reference::authors && pyramid.budget.max_capacity_prompt == 40));
  CHECK(pyramid.budget.keep(0, 0, 200) == 71);
  py.layer = 3;
  CHECK(kvc::detail::decode_selection(kvc::TopKSelector{py, 0, 8}, schedule).budget.keep(0, 0, 200) == 11);

  // Two sequences through one compressor: after reset(), the second equals a fresh compressor's.
  Scenario const sc;
  kvc::KVExtents const e = sc.keys();
  auto make = [&](std::uint64_t salt, std::vector<float>& k, std::vector<float>& v, std::vector<Index>& lengths,
                  std::vector<Index>& positions) {
    k = sc.fill(salt, static_cast<std::size_t>(e.rows() * e.dim));
    v = sc.fill(salt + 1, k.size());
    lengths.assign(static_cast<std::size_t>(e.batch * e.heads), 40);
    positions.resize(static_cast<std::size_t>(e.rows()));
    for (Index i = 0; i < e.rows(); ++i)
      positions[static_cast<std::size_t>(i)] = i % e.tokens;
    return kvc::dense_cache(k.data(), v.data(), e, kvc::head_lengths(lengths.data(), e.heads), positions.data());
  };
  kvc::KVExtents const wq{e.batch, sc.q_heads, sc.window, e.dim};
  std::vector<float> const q = sc.fill(3, static_cast<std::size_t>(wq.rows() * e.dim));
  std::vector<Index> const qpos(static_cast<std::size_t>(e.batch * sc.window), 39);
  kvc::LayerQueries<float> const queries{{q.data(), kvc::bhtd_layout(wq)}, qpos.data()};
  kvc::Press const policy{kvc::H2OScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}, 0, 4}};
  kvc::LayerCompressor reused(kvc::Cpu{}, policy), fresh(kvc::Cpu{}, policy);
  std::vector<float> k1, v1, k2, v2, k3, v3;
  std::vector<Index> l1, p1, l2, p2, l3, p3;
  auto const a = make(50, k1, v1, l1, p1), b = make(60, k2, v2, l2, p2), b2 = make(60, k3, v3, l3, p3);
  REQUIRE(reused.plan(a, kvc::QueryShape{sc.q_heads, sc.window, 1, 1}).ok());
  REQUIRE(fresh.plan(a, kvc::QueryShape{sc.q_heads, sc.window, 1, 1}).ok());
  // Both states 64-byte aligned, so that their pieces lie at the same offsets and the bytes compare.
  HostMemory memory;
  std::size_t const bytes = reused.state_bytes();
  std::byte *s1 = memory.alloc<std::byte>(bytes), *s2 = memory.alloc<std::byte>(bytes);
  kvc::test::OwnedWorkspace ws(reused.workspace_bytes());
  REQUIRE((reused.bind(s1, bytes).ok() && reused.reset().ok()));
  REQUIRE((fresh.bind(s2, bytes).ok() && fresh.reset().ok()));
  REQUIRE(reused.prefill(a, queries, ws.get()).ok());
  REQUIRE(reused.reset().ok());
  REQUIRE(reused.prefill(b, queries, ws.get()).ok());
  REQUIRE(fresh.prefill(b2, queries, ws.get()).ok());
  CHECK(l2 == l3);
  CHECK(p2 == p3);
  CHECK(std::equal(s1, s1 + bytes, s2));  // the accumulators too
}

TEST_CASE("layer compressor: 16-bit queries give the kept set of their fp32 values", "[engine][compressor]") {
  // The prompt's queries rounded to fp16 and handed to LayerCompressor<..., half> keep what the same values in
  // fp32 keep (scorers widen query rows exactly).
  Scenario const sc;
  kvc::Press const policy{kvc::SnapKVScorer{kvc::Reference::authors, sc.window, 3},
                          kvc::TopKSelector{kvc::RatioBudget{0.5}}};
  HostPrompt wide{sc}, narrow{sc};
  std::vector<kvc::half> q16(wide.q.size());
  for (std::size_t i = 0; i < q16.size(); ++i) {
    q16[i] = kvc::half(wide.q[i]);
    wide.q[i] = kvc::to_float(q16[i]);
  }
  kvc::test::OwnedRope const rope(kvc::RopeSpec{}, sc.dim, sc.rope_positions);
  kvc::CompressorOptions<kvc::HostSpace> options;
  options.rope = rope.table;
  kvc::LayerCompressor<std::remove_const_t<decltype(policy)>, kvc::Cpu, float> f32(kvc::Cpu{}, policy, options);
  kvc::LayerCompressor<std::remove_const_t<decltype(policy)>, kvc::Cpu, kvc::half> f16(kvc::Cpu{}, policy, options);
  kvc::QueryShape const shape{sc.q_heads, sc.window, 1, 1};
  REQUIRE((f32.plan(wide.cache(), shape).ok() && f16.plan(narrow.cache(), shape).ok()));
  std::vector<std::byte> s32(f32.state_bytes()), s16(f16.state_bytes());
  kvc::test::OwnedWorkspace w32(f32.workspace_bytes()), w16(f16.workspace_bytes());
  REQUIRE((f32.bind(s32.data(), s32.size()).ok() && f32.reset().ok()));
  REQUIRE((f16.bind(s16.data(), s16.size()).ok() && f16.reset().ok()));
  REQUIRE(f32.prefill(wide.cache(), {wide.rows(), wide.qpos.data()}, w32.get()).ok());
  kvc::TokenRows<kvc::half const, kvc::StridedLayout> const rows16(q16.data(),
                                                                   kvc::bhtd_layout(sc.prompt_query_extents()));
  REQUIRE(f16.prefill(narrow.cache(), {rows16, narrow.qpos.data()}, w16.get()).ok());
  CHECK(wide.lengths == narrow.lengths);
  CHECK(wide.positions == narrow.positions);
  CHECK(wide.lengths != sc.prompt_lengths());  // it compressed
}
